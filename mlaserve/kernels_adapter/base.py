"""The narrow interface every MLA attention kernel is adapted to.

Contract
--------
The model computes, per layer, the *weight-absorbed* query and the new tokens' latent KV, and
hands them to `forward`. The backend stores the new KV in the paged pool (at
`batch.slot_mapping`) and returns attention over each sequence's cached prefix plus its new
tokens, causal among the new tokens:

    q_nope  [T, H, kv_lora_rank]    q_nope @ W_UK, i.e. already in the 512-wide latent space
    q_pe    [T, H, qk_rope_head_dim] RoPE applied
    kv_c    [T, kv_lora_rank]        normalized latent of the new tokens
    k_pe    [T, qk_rope_head_dim]    RoPE applied, shared by all heads
    returns [T, H, kv_lora_rank]     softmax(q.k * softmax_scale) @ c_kv, in the model dtype

A backend with `accepts_written_kv = True` also takes `kv_c = k_pe = None`: the layer has
already stored the new tokens' KV at `batch.slot_mapping` (on CUDA, fused into its latent
RMSNorm + RoPE kernel, `mlaserve/ops/mla_norm_rope.py`), so the backend only attends.

A backend may also take the *joined query* for a batch: `joined_q_dtype(batch)` names the dtype
it wants it in (None, the default: it does not, for this batch). The layer then has W_UK's
per-head GEMV write the kernel's whole query in one launch (`mlaserve/ops/head_gemv.py`, `tail`)
when it has written the new KV itself and the GEMV path runs (<= HEAD_GEMV_MAX_M tokens), and
calls `forward_joined` instead of `forward`:

    q       [T, H, kv_lora_rank + qk_rope_head_dim]  contiguous, in joined_q_dtype(batch):
            [q_nope @ W_UK | q_pe], for e4m3 saturated to +-448 then cast (unscaled)
    returns [T, H, kv_lora_rank]  as `forward`, in the kernel's output dtype (the layer casts
            it to the model dtype where they differ)

Query row i of a sequence with `q_len` new tokens and KV length `L` (= seq_lens[b]) sees keys
`0 .. L - q_len + i` inclusive.

Which path runs is the batch's stated `mode` (never its shapes): uniform modes (DECODE, VERIFY,
DRAFT_EXTEND; q_len <= `max_uniform_q_len`) go to the backend's decode kernel, EXTEND to its
prefill path. A backend with `mha_extend = True` takes EXTEND batches in the MHA form instead
(`forward_extend_mha`): the layer hands it the non-absorbed query and the up-projections, and
the backend returns the per-head values, so a dense causal prefill kernel can run.

`prepare(batch)` builds whatever per-forward metadata the kernel needs from the batch's device
buffers. It must not read device values on the host: the CUDA graph runner calls it inside the
captured region (or before replay), and the host-side ints it may use (`bs`, `q_len`,
`max_seq_len`) are fixed per captured graph.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from mlaserve.config import ModelConfig
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["AttentionBackend", "BackendUnsupportedError"]


class BackendUnsupportedError(ValueError):
    """The chosen backend cannot run this configuration (device, dtype, page size, shape)."""


class AttentionBackend(ABC):
    name: ClassVar[str]
    #: whether `prepare` + `forward` in uniform modes may be captured into a CUDA graph
    supports_cuda_graph: ClassVar[bool] = False
    #: the largest q_len per sequence the decode kernel takes (VERIFY needs k+1)
    max_uniform_q_len: ClassVar[int] = 16
    #: EXTEND batches go through `forward_extend_mha` (MHA form) instead of `forward`
    mha_extend: ClassVar[bool] = False
    #: `forward` takes kv_c = k_pe = None when the layer has written the new KV itself
    accepts_written_kv: ClassVar[bool] = False
    #: `forward_extend_mha` may be captured into a CUDA graph for one fresh prompt (no cached
    #: prefix) padded to a token bucket, given `mha_extend.fresh_layout` as `batch.attn_metadata`
    #: (no `prepare`): it then launches device work of fixed shapes only, reads no device value
    #: on the host, and reads the context through the layout's slots alone
    captures_fresh_extend: ClassVar[bool] = False

    def __init__(
        self,
        model_config: ModelConfig,
        page_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        *,
        max_q_len: int = 1,
    ) -> None:
        """`max_q_len`: the largest uniform q_len the engine will use (1 for plain decode, k+1
        with speculation). Backends that size buffers for the decode kernel (a split-KV
        workspace) size them for it once, here, so nothing is allocated while serving."""
        if not 1 <= max_q_len <= self.max_uniform_q_len:
            raise BackendUnsupportedError(
                f"max_q_len: {type(self).__name__} takes 1 to {self.max_uniform_q_len} tokens "
                f"per sequence in its decode kernel, got {max_q_len}"
            )
        self.model_config = model_config
        self.page_size = page_size
        self.kv_cache_dtype = kv_cache_dtype
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_q_len = max_q_len
        self.num_heads = model_config.num_attention_heads
        self.kv_lora_rank = model_config.kv_lora_rank
        self.qk_rope_head_dim = model_config.qk_rope_head_dim
        self.softmax_scale = model_config.softmax_scale

    @classmethod
    def check_supported(
        cls,
        model_config: ModelConfig,
        page_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Raise `BackendUnsupportedError` with a clear message if this backend cannot run.
        The default accepts everything (the reference backend runs anywhere)."""
        return None

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-forward metadata into `batch.attn_metadata`. Device ops only."""

    @abstractmethod
    def forward(
        self,
        layer_id: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor | None,
        k_pe: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Write the new KV of `layer_id` (unless None: already written), then attend. Shapes
        in the module docstring."""

    def joined_q_dtype(self, batch: ForwardBatch) -> torch.dtype | None:
        """The dtype in which this backend takes a joined query for `batch` (`forward_joined`),
        or None (the default): the layer calls `forward`. Host values only (graph capture)."""
        return None

    def forward_joined(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Attend with the joined query q [T, H, r + d_r] (contiguous, `joined_q_dtype(batch)`);
        the layer has written the new KV. Returns [T, H, r]. Only called when `joined_q_dtype`
        names a dtype for `batch`."""
        raise NotImplementedError(f"{type(self).__name__} takes no joined queries")

    def forward_extend_mha(
        self,
        layer_id: int,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """EXTEND in the MHA form of MLA (only called when `mha_extend`). Writes the new latent
        KV, then attends every new token over its sequence's whole context, causally:

            q     [T, H, d_n + d_r]  not absorbed, RoPE applied to the last d_r
            kv_c  [T, r], k_pe [T, d_r]  the new tokens' latent and rope key (as in `forward`)
            w_uk  [H, d_n, r]   k_nope_h = W_UK_h c     (views of kv_b_proj's weight)
            w_uv  [H, r, d_v]   v_h = c W_UV_h
            returns [T, H, d_v] in q's dtype (the layer skips its own W_UV)

        Keys of the cached prefix are up-projected from the pool's latent, so chunked prefill
        over an existing prefix is exact."""
        raise NotImplementedError(f"{type(self).__name__} has no MHA-form EXTEND path")
