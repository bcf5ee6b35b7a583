"""DeepSeek-V2 / V3 causal LM over a paged MLA cache.

    hidden = embed(input_ids)
    for each layer:  hidden += MLA(norm(hidden));  hidden += FFN(norm(hidden))
    return norm(hidden)                 # `model(batch)`;  logits = lm_head(hidden)

An EXTEND batch whose readers want only its logits rows (`batch.logits_hidden_only`: no draft
model reads the rest) runs the last layer's o_proj and FFN on those rows alone, after an
attention over every row (whose KV the cache needs): llama.cpp's `inp_out_ids`. For one 2048-token
V2-Lite prompt that skips the MoE of 2047 rows in the last of 26 layers.

Each `hidden += ...` is deferred into the next norm (`forward_residual`), which on CUDA is one
fused add + RMSNorm kernel (`mlaserve/ops/rms_norm.py`); the roundings are the same.

FFN is the dense SwiGLU MLP for the first `first_k_dense_replace` layers (and off the
`moe_layer_freq` grid), the MoE elsewhere. Module and parameter names follow the HF
checkpoints, except the fused `gate_up_proj` / stacked experts (see `loader.py`).

Tensor parallelism (`tp`, `mlaserve/tensor_parallel.py`; eager, as vLLM/SGLang split DeepSeek):
the embedding and LM head split the (padded) vocabulary (masked lookup + all-reduce; logits
all-gathered, so every rank has all of them), MLA splits its heads (`mla.py`), the dense MLPs and
shared experts their intermediate (gate/up column-, down row-parallel), the routed experts each
expert's intermediate; each layer ends in one all-reduce per block (o_proj; the MoE's routed +
shared sum), so the residual stream, the norms, the router and the latent KV cache are the same
on every rank. The MTP layer is split like a decoder layer.

The forward reads only `batch.input_ids`, `batch.positions` and hands `batch` to the attention
backend; it never reads device values on the host (on CUDA), so DECODE batches can be captured
in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve.config import ModelConfig, QuantizationConfig
from mlaserve.model.kernel_warm_up import warm_up_concurrently
from mlaserve.model.layers.decoder_layer import DeepseekDecoderLayer
from mlaserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mlaserve.model.layers.linear import NO_TP, TensorParallel
from mlaserve.model.layers.mla import MLAAttention
from mlaserve.model.layers.moe import DeepseekMoE
from mlaserve.model.layers.norm import RMSNorm
from mlaserve.model.layers.rotary import RotaryEmbedding
from mlaserve.model.mtp import DeepseekMTP

if TYPE_CHECKING:
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["DeepseekForCausalLM", "DeepseekModel"]


class DeepseekModel(nn.Module):
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
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, params_dtype=params_dtype, tp=tp
        )
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(
                config,
                i,
                params_dtype=params_dtype,
                tp=tp,
                quant=quant,
                deterministic=deterministic,
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, params_dtype=params_dtype,
            deterministic=deterministic,
        )  # fmt: skip

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> [T, hidden] final-normed hidden states; [num_logits, hidden], of the
        `logits_indices` rows, when `batch.logits_hidden_only`."""
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary_emb(batch.positions)  # shared by all layers
        residual = None
        last = len(self.layers) - 1
        rows = batch.logits_indices if batch.logits_hidden_only else None
        for i, layer in enumerate(self.layers):
            keep = rows if i == last else None
            x, residual = layer.forward_residual(x, residual, cos, sin, batch, keep)
        return self.norm(x) if residual is None else self.norm.forward_with_residual(x, residual)[0]


class DeepseekForCausalLM(nn.Module):
    """The served model. Build it with `mlaserve.model.load_model`.

    `quant`: keep the checkpoint's FP8 block weights in FP8 (attention and MLP/expert linears
    except kv_b_proj; embeddings, LM head, norms and router stay in params_dtype). None: every
    weight in params_dtype (an FP8 checkpoint is then dequantised by the loader).
    `deterministic`: every layer built batch-invariant (`EngineConfig.deterministic_inference`;
    the linears, MLA, MoE, norms and LM head say how)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        with_mtp: bool = False,
        quant: QuantizationConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.params_dtype = params_dtype
        self.tp = tp
        kw = {"params_dtype": params_dtype, "tp": tp, "deterministic": deterministic}
        self.model = DeepseekModel(config, quant=quant, **kw)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, **kw)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp: DeepseekMTP | None = None
        if with_mtp:
            self.mtp = DeepseekMTP(config, quant=quant, **kw)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """ForwardBatch -> [T, hidden] final-normed hidden states (attention backend prepared)."""
        return self.model(batch)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab_size] float32"""
        return self.lm_head(hidden)

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, (MLAAttention, DeepseekMoE)):
                module.process_weights_after_loading()

    def kernel_warm_up_tasks(self) -> list[Callable[[], None]]:
        """The decode GEMVs' and the grouped MoE kernels' compiles for every token count they
        take (not only the captured batch sizes that warm-up runs), so none compiles while
        serving: a task per variant (`kernel_warm_up.py`). Modules of one type and parameter
        shapes take the same compiled variants, so each such kind is warmed once (one MoE layer
        of V2-Lite's 26, not all of them). The MoE's and MLA's tasks come first: the pool takes
        tasks in order, and theirs are the longest."""
        warmed: set[tuple] = set()
        first: list[Callable[[], None]] = []
        rest: list[Callable[[], None]] = []
        for module in self.modules():
            make = getattr(module, "warm_up_tasks", None)
            kind = _kind(module)
            if make is not None and kind not in warmed:  # linears, the router, MoE, MLA
                warmed.add(kind)
                tasks = make(self.params_dtype)
                (first if isinstance(module, (DeepseekMoE, MLAAttention)) else rest).extend(tasks)
        return first + rest

    def layer_warm_up_tasks(self, token_counts: Sequence[int]) -> list[Callable[[], None]]:
        """A task per decoder-layer kind (dense or MoE FFN) and token count: its kernels but
        the attention kernel's, at that count (`DeepseekDecoderLayer.warm_up`), for the token
        counts the engine's forwards take (the captured batch sizes, the prefill buckets)."""
        kinds: dict[tuple, DeepseekDecoderLayer] = {}
        for layer in self.modules():
            if isinstance(layer, DeepseekDecoderLayer):
                kinds.setdefault((type(layer.mlp), *_kind(layer)), layer)
        return [
            partial(layer.warm_up, num_tokens, self.params_dtype)
            for num_tokens in token_counts
            for layer in kinds.values()
        ]

    def warm_up_decode_kernels(self) -> None:
        """`kernel_warm_up_tasks`, run now: on threads, but in order under tensor parallelism
        (the MoE's warm-up forward all-reduces, and every rank must issue its collectives in one
        order, which threads would not keep)."""
        device = next(self.parameters()).device
        warm_up_concurrently(self.kernel_warm_up_tasks(), device, in_order=self.tp.size > 1)


def _kind(module: nn.Module) -> tuple:
    """Its type and its parameters' shapes and dtypes: modules of one kind compile the same
    kernel variants, so warm-up runs one of them."""
    return (type(module), *((p.shape, p.dtype) for p in module.parameters()))
