"""DeepSeek-V3's multi-token-prediction (MTP) module: one extra decoder layer that predicts the
token after next from (the next token's embedding, the main model's hidden state).

Checkpoint layout (`model.layers.{N}.*`, N = num_hidden_layers):

    embed_tokens        its own copy of the embedding (tied to the main one if absent)
    enorm, hnorm        RMSNorms of the embedding and of the incoming hidden state
    eh_proj             [hidden, 2*hidden]: cat(enorm(e), hnorm(h)) -> hidden
    self_attn, mlp, input_layernorm, post_attention_layernorm   a normal (MoE) decoder layer
    shared_head.norm    final norm
    shared_head.head    its own copy of the LM head (tied to the main one if absent)

Row i consumes token i+1's embedding and the main model's final-normed hidden state at
position i; its logits predict token i+2. Its attention caches latents under layer id N of the
KV pool, so the pool needs `num_hidden_layers + 1` layers when MTP runs. The rows' positions may
be i (sglang/vLLM) or i+1 (transformers): RoPE is relative, so either gives the same result as
long as one convention fills the whole MTP cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.config import ModelConfig, QuantizationConfig
from mlaserve.model.layers.decoder_layer import DeepseekDecoderLayer
from mlaserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mlaserve.model.layers.linear import NO_TP, ReplicatedLinear, TensorParallel
from mlaserve.model.layers.norm import RMSNorm
from mlaserve.model.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["DeepseekMTP"]


class SharedHead(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        params_dtype: torch.dtype,
        tp: TensorParallel,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        det = {"deterministic": deterministic}
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, params_dtype=params_dtype, **det
        )
        self.head = ParallelLMHead(
            config.vocab_size, config.hidden_size, params_dtype=params_dtype, tp=tp, **det
        )


class DeepseekMTP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        quant: QuantizationConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        det = {"deterministic": deterministic}
        self.layer_id = config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, hidden, params_dtype=params_dtype, tp=tp
        )
        self.rotary_emb = RotaryEmbedding(config)
        self.enorm = RMSNorm(hidden, eps, params_dtype=params_dtype, **det)
        self.hnorm = RMSNorm(hidden, eps, params_dtype=params_dtype, **det)
        # eh_proj is bf16 in the published FP8 checkpoints (an FP8 one is dequantised at load).
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, params_dtype=params_dtype, tp=tp, **det)
        self.block = DeepseekDecoderLayer(
            config, self.layer_id, params_dtype=params_dtype, tp=tp, quant=quant, **det
        )  # checkpoint: model.layers.{N}.{self_attn,mlp,*_layernorm}
        self.shared_head = SharedHead(config, params_dtype, tp, deterministic)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """input_ids [T] (token i+1), positions [T], hidden_states [T, hidden] (main model's
        final-normed state at position i) -> [T, hidden] after shared_head.norm."""
        e = self.enorm(self.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden_states)], dim=-1))
        cos, sin = self.rotary_emb(positions)
        out, residual = self.block.forward_residual(x, None, cos, sin, batch)
        return self.shared_head.norm.forward_with_residual(out, residual)[0]  # norm(out + res)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size] float32"""
        return self.shared_head.head(hidden)
