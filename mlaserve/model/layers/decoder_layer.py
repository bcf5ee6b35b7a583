"""One DeepSeek decoder layer: MLA attention, then the dense SwiGLU MLP or the MoE, each behind
an RMSNorm. Its own module because both the main model (`deepseek.py`) and the MTP head
(`mtp.py`) build it, and neither of those may import the other's module for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.config import ModelConfig, QuantizationConfig
from mlaserve.model.layers.linear import NO_TP, TensorParallel
from mlaserve.model.layers.mla import MLAAttention
from mlaserve.model.layers.mlp import DeepseekMLP
from mlaserve.model.layers.moe import DeepseekMoE
from mlaserve.model.layers.norm import RMSNorm
from mlaserve.ops.moe_partials import MoePartials, SortedExpertRows
from mlaserve.tensor_parallel import RankPartials

if TYPE_CHECKING:
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["DeepseekDecoderLayer"]


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        quant: QuantizationConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        kw = {
            "params_dtype": params_dtype,
            "tp": tp,
            "quant": quant,
            "deterministic": deterministic,
        }
        norm_kw = {"params_dtype": params_dtype, "deterministic": deterministic}
        self.self_attn = MLAAttention(config, layer_id, **kw)
        self.mlp: DeepseekMoE | DeepseekMLP
        if config.is_moe_layer(layer_id):
            self.mlp = DeepseekMoE(config, **kw)
        else:
            self.mlp = DeepseekMLP(
                config.hidden_size, config.intermediate_size, hidden_act=config.hidden_act, **kw
            )
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, **norm_kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, **norm_kw)

    def forward_residual(
        self,
        x: torch.Tensor | MoePartials | SortedExpertRows | RankPartials,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | MoePartials | SortedExpertRows | RankPartials, torch.Tensor]:
        """The layer on input `x + residual` (`x` alone when residual is None), returned as the
        pair (FFN output, residual stream before it) whose sum is the layer's output. The sum is
        left to the next norm, which fuses it (`RMSNorm.forward_with_residual`): the same
        roundings as adding first, one kernel fewer per norm on CUDA. An MoE layer's output may
        come uncombined (`MoePartials`, `SortedExpertRows`, on CUDA): the next norm sums it in
        the same launch. Under tensor parallelism on CUDA, attention's and the FFN's outputs
        come as this rank's partial sums (`RankPartials`): the next norm all-reduces them.
        `rows`: the only rows read after this layer; past attention it runs on them alone."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h = self.self_attn(h, cos, sin, batch, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        if isinstance(self.mlp, DeepseekMoE):  # its combine happens in the next norm
            return self.mlp(h, combine=False), residual
        return self.mlp(h, partials=True), residual

    @torch.no_grad()
    def warm_up(self, num_tokens: int, act_dtype: torch.dtype) -> None:
        """Run every kernel of `forward_residual` but the attention kernel's (which needs a
        batch) on `num_tokens` rows of zeros, as it calls them: the first layer's lone norm,
        the fused residual norms, attention's projections (the q_a norm's included), the FFN,
        and the next layer's norm summing its uncombined output; so that they compile for that
        token count before serving (`model/kernel_warm_up.py` runs this on a thread)."""
        weight = self.input_layernorm.weight  # [hidden]
        x = torch.zeros(num_tokens, weight.shape[0], dtype=act_dtype, device=weight.device)
        h, residual = self.input_layernorm(x), x
        h, residual = self.input_layernorm.forward_with_residual(h, residual)
        self.self_attn.project(h)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        moe = isinstance(self.mlp, DeepseekMoE)
        out = self.mlp(h, combine=False) if moe else self.mlp(h, partials=True)
        self.input_layernorm.forward_with_residual(out, residual)
