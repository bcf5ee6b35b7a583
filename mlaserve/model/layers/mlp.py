"""The SwiGLU feed-forward block: dense layers and the MoE's shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config import ConfigError, QuantizationConfig
from mlaserve.model.layers.linear import (
    NO_TP,
    MergedColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
)
from mlaserve.ops import fused_ops_enabled
from mlaserve.tensor_parallel import RankPartials

__all__ = ["DeepseekMLP", "silu_and_mul"]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> [..., I] = silu(gate) * up"""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class DeepseekMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up run as one GEMM (`gate_up_proj`).

    Under TP each rank computes its slice of the intermediate and a partial [T, hidden] down
    projection; the sum over ranks is down_proj's all-reduce, or the caller's with
    `reduce_output=False` (the MoE sums its shared and routed experts in one).
    `deterministic`: batch-invariant linears (`linear.py`); SiLU-and-mul is elementwise."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        hidden_act: str = "silu",
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        reduce_output: bool = True,
        quant: QuantizationConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is supported, got {hidden_act!r}")
        # gate/up column-parallel, down row-parallel: rank r holds intermediate [r*I/tp, ...)
        tp.split(intermediate_size, "intermediate_size (dense MLP / shared experts)")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, params_dtype=params_dtype, tp=tp, quant=quant,
            deterministic=deterministic,
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            params_dtype=params_dtype,
            tp=tp,
            reduce_output=reduce_output,
            quant=quant,
            deterministic=deterministic,
        )
        # One Triton kernel on CUDA (`mlaserve/ops/silu_and_mul.py`), the torch reference elsewhere.
        self.act = silu_and_mul
        if fused_ops_enabled(self.gate_up_proj.weight.device):
            from mlaserve.ops.silu_and_mul import silu_and_mul as fused_silu_and_mul

            self.act = fused_silu_and_mul

    def forward(self, x: torch.Tensor, *, partials: bool = False) -> torch.Tensor | RankPartials:
        """[T, hidden] -> [T, hidden]. `partials` (a dense layer's FFN): down_proj's all-reduce
        left to the next norm where it can take it (`RowParallelLinear.forward_partials`)."""
        h = self.act(self.gate_up_proj(x))
        return self.down_proj.forward_partials(h) if partials else self.down_proj(h)
