"""One MoE layer's routed experts as parameters: all experts' weights stacked, and their loading.

    gate_up_proj  [E, 2I, H]  rows [0, I) gate, [I, 2I) up
    down_proj     [E, H, I]

Built with `quant`, both are FP8 with block scales (`gate_up_proj_scale_inv` [E, 2I/128 or 2I,
H/128], `down_proj_scale_inv` [E, H/128, I/128]; layout in `fp8_linear.py`). How the experts run
is `moe_experts.FusedExperts`, which builds on this.
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.config import QuantizationConfig
from mlaserve.model.layers.fp8_linear import (
    check_block_aligned,
    copy_block_rows,
    make_fp8_weight,
    needs_per_row_scales,
    shard_block_weight,
)
from mlaserve.model.layers.linear import NO_TP, TensorParallel, check_shape

__all__ = ["ExpertWeights"]


class ExpertWeights(nn.Module):
    """All routed experts of a layer, weights stacked. Tensor parallel splits each expert's
    intermediate dim (rank r keeps gate/up rows and down columns [r*I/tp, (r+1)*I/tp))."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        quant: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.tp = num_experts, hidden_size, tp
        self.intermediate_size = intermediate_size
        local = tp.split(intermediate_size, "moe_intermediate_size")
        self.quant = quant
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None
        if quant is None:
            self.gate_up_proj = nn.Parameter(
                torch.empty(num_experts, 2 * local, hidden_size, dtype=params_dtype),
                requires_grad=False,
            )  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
            self.down_proj = nn.Parameter(
                torch.empty(num_experts, hidden_size, local, dtype=params_dtype),
                requires_grad=False,
            )  # [E, H, I]
            self.gate_up_proj.weight_loader = self.weight_loader
            self.down_proj.weight_loader = self.weight_loader
        else:
            what = f"routed experts ({num_experts} x [{intermediate_size}, {hidden_size}])"
            check_block_aligned(
                intermediate_size, tp, quant.block_n, f"{what} moe_intermediate_size"
            )
            self.gate_up_per_row = needs_per_row_scales([local, local], quant)
            self.gate_up_proj, self.gate_up_proj_scale_inv = make_fp8_weight(
                (num_experts,), 2 * local, hidden_size, quant, per_row=self.gate_up_per_row
            )
            self.down_proj, self.down_proj_scale_inv = make_fp8_weight(
                (num_experts,), hidden_size, local, quant, per_row=False
            )
            self.gate_up_proj.weight_loader = self.fp8_weight_loader
            self.down_proj.weight_loader = self.fp8_weight_loader

    def fp8_weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        expert_id: int | None = None,
        shard_id: int | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        """One expert's FP8 `gate_proj`/`up_proj` [I, H] (shard_id 0/1) or `down_proj` [H, I]
        with its block `scale` (a float tensor is quantised here). The fused whole-layer form
        (`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]) is accepted in float
        only: FP8 checkpoints publish per-expert tensors, and no fused scale layout exists.
        Under TP the weight and its scale are sliced alike along I (`shard_block_weight`)."""
        assert self.quant is not None  # internal: only set as loader of FP8 parameters
        h, i = self.hidden_size, self.intermediate_size
        local, tp, block = i // self.tp.size, self.tp, self.quant.block_n
        if expert_id is None:
            if scale is not None:
                raise ValueError("FP8 experts must come one tensor per expert (experts.{e}.*)")
            down = param is self.down_proj
            check_shape(loaded, (self.num_experts, h, i) if down else (self.num_experts, 2 * i, h))
            for e in range(self.num_experts):
                if down:
                    self.fp8_weight_loader(param, loaded[e], e)
                else:
                    for s in (0, 1):
                        self.fp8_weight_loader(param, loaded[e, s * i : (s + 1) * i], e, s)
            return
        if param is self.down_proj:
            check_shape(loaded, (h, i))
            loaded, scale = shard_block_weight(loaded, scale, 1, tp, self.quant.block_k)
            dst_scale, row, per_row = self.down_proj_scale_inv, 0, False
        else:
            assert shard_id in (0, 1)  # internal: the loader passes 0 (gate) or 1 (up)
            check_shape(loaded, (i, h))
            loaded, scale = shard_block_weight(loaded, scale, 0, tp, block)
            dst_scale, row, per_row = (
                self.gate_up_proj_scale_inv,
                shard_id * local,
                self.gate_up_per_row,
            )
        assert dst_scale is not None  # internal: both are set when quant is
        copy_block_rows(
            param.data[expert_id],
            dst_scale.data[expert_id],
            loaded,
            scale,
            row,
            self.quant,
            per_row=per_row,
        )

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        expert_id: int | None = None,
        shard_id: int | None = None,
    ) -> None:
        """Either a whole stacked tensor (transformers' fused `experts.gate_up_proj` [E, 2I, H] /
        `experts.down_proj` [E, H, I]) or one expert's `gate_proj`/`up_proj` [I, H]
        (shard_id 0/1) or `down_proj` [H, I]."""
        num_e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        local = i // self.tp.size
        start = self.tp.rank * local
        if param is self.down_proj:
            if expert_id is None:
                check_shape(loaded, (num_e, h, i))
                param.data.copy_(loaded.narrow(2, start, local))
            else:
                check_shape(loaded, (h, i))
                param.data[expert_id].copy_(loaded.narrow(1, start, local))
            return
        if expert_id is None:
            check_shape(loaded, (num_e, 2 * i, h))
            for s in (0, 1):  # gate, up
                param.data[:, s * local : (s + 1) * local].copy_(
                    loaded.narrow(1, s * i + start, local)
                )
        else:
            assert shard_id in (0, 1)  # internal: the loader passes 0 (gate) or 1 (up)
            check_shape(loaded, (i, h))
            param.data[expert_id, shard_id * local : (shard_id + 1) * local].copy_(
                loaded.narrow(0, start, local)
            )
