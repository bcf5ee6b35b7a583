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

Heads are per tensor-parallel rank: `H` above is the backend's `num_heads`, the heads this rank
attends (`num_attention_heads // tp_size`: DeepSeek-V3's 128 heads are 128 / 64 / 32 / 16 a
rank at TP 1 / 2 / 4 / 8). It is a constructor argument (default: all of the model's heads, TP1),
checked once there (`per_rank_heads`) and against each kernel's limits for the largest q_len
(`check_shape`, and each backend's `check_supported` / `check_target`); every buffer, workspace
and schedule is sized for it, and `forward` refuses a query with another head count
(`check_heads`), never re-deriving H from a tensor's shape. The latent KV (`kv_c`, `k_pe`, the
pool) has no head axis: every rank holds all of it.

`prepare(batch)` builds whatever per-forward metadata the kernel needs from the batch's device
buffers. It must not read device values on the host: the CUDA graph runner calls it inside the
captured region (or before replay), and the host-side ints it may use (`bs`, `q_len`,
`max_seq_len`) are fixed per captured graph.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from mlaserve.config import ModelConfig
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["AttentionBackend", "BackendUnsupportedError", "per_rank_heads"]


class BackendUnsupportedError(ValueError):
    """The chosen backend cannot run this configuration (device, dtype, page size, shape)."""


def per_rank_heads(model_config: ModelConfig, num_heads: int | None) -> int:
    """The attention heads one tensor-parallel rank attends: `num_heads`, which must be a
    positive divisor of the model's `num_attention_heads` (the ranks split the heads evenly);
    None means all of them (TP1). Raises ValueError naming both counts otherwise."""
    total = model_config.num_attention_heads
    if num_heads is None:
        return total
    if (
        isinstance(num_heads, bool)
        or not isinstance(num_heads, int)
        or num_heads < 1
        or total % num_heads
    ):
        raise ValueError(
            f"num_heads: the heads a rank attends (num_attention_heads // tensor_parallel_size) "
            f"must be a positive divisor of the model's num_attention_heads {total}, got "
            f"{num_heads!r}"
        )
    return num_heads


class AttentionBackend(ABC):
    name: ClassVar[str]
    #: whether `prepare` + `forward` in uniform modes may be captured into a CUDA graph
    supports_cuda_graph: ClassVar[bool] = False
    #: the largest q_len per sequence the decode kernel takes at any head count (VERIFY needs
    #: k+1); `max_q_len_for(num_heads)` is the limit for a given per-rank head count
    max_uniform_q_len: ClassVar[int] = 16
    #: why the limit is what it is, appended to a refused max_q_len's error
    q_len_rule: ClassVar[str] = ""
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
        num_heads: int | None = None,
    ) -> None:
        """`max_q_len`: the largest uniform q_len the engine will use (1 for plain decode, k+1
        with speculation). Backends that size buffers for the decode kernel (a split-KV
        workspace) size them for it once, here, so nothing is allocated while serving.

        `num_heads`: the heads this rank attends, `num_attention_heads // tp_size` (default:
        all of them, TP1); a ValueError unless it divides the model's heads. Every per-head
        buffer, workspace and schedule is sized for it, and queries must carry exactly it."""
        num_heads = self.check_shape(model_config, num_heads, max_q_len)
        self.model_config = model_config
        self.page_size = page_size
        self.kv_cache_dtype = kv_cache_dtype
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_q_len = max_q_len
        self.num_heads = num_heads  # per rank
        self.kv_lora_rank = model_config.kv_lora_rank
        self.qk_rope_head_dim = model_config.qk_rope_head_dim
        self.softmax_scale = model_config.softmax_scale

    @classmethod
    def max_q_len_for(cls, num_heads: int) -> int:
        """The largest uniform q_len the decode kernel takes with `num_heads` heads a rank.
        Default: `max_uniform_q_len` at any head count."""
        return cls.max_uniform_q_len

    @classmethod
    def check_shape(
        cls, model_config: ModelConfig, num_heads: int | None = None, max_q_len: int = 1
    ) -> int:
        """The per-rank head count (`per_rank_heads`: ValueError unless it divides the model's),
        after checking that the decode kernel takes `max_q_len` tokens per sequence with it
        (`BackendUnsupportedError` otherwise). Host ints only."""
        heads = per_rank_heads(model_config, num_heads)
        limit = cls.max_q_len_for(heads)
        if not 1 <= max_q_len <= limit:
            rule = f" ({cls.q_len_rule})" if cls.q_len_rule else ""
            raise BackendUnsupportedError(
                f"max_q_len: {cls.__name__} takes 1 to {limit} tokens per sequence in its decode "
                f"kernel with {heads} heads a rank, got {max_q_len}{rule}"
            )
        return heads

    @classmethod
    def check_supported(
        cls,
        model_config: ModelConfig,
        page_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        *,
        num_heads: int | None = None,
        max_q_len: int = 1,
    ) -> None:
        """Raise `BackendUnsupportedError` with a clear message if this backend cannot run with
        `num_heads` heads a rank (None: all, TP1) and uniform batches of up to `max_q_len`
        tokens per sequence (ValueError for a head count that does not divide the model's).
        The default checks only the q_len limit (the reference backend runs anywhere)."""
        cls.check_shape(model_config, num_heads, max_q_len)

    def check_heads(self, x: torch.Tensor, what: str) -> None:
        """`x` [T, H, ...] must carry this rank's `num_heads` heads on dim 1: the count the
        backend was built and sized for, never taken from the tensor. A host check of the
        shape (no device read: capturable)."""
        if x.dim() < 2 or x.shape[1] != self.num_heads:
            raise ValueError(
                f"{type(self).__name__}: {what} {tuple(x.shape)} must have {self.num_heads} "
                f"heads on dim 1, the heads this rank attends (built with num_heads="
                f"{self.num_heads} of the model's {self.model_config.num_attention_heads})"
            )

    def check_mha_heads(self, q: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
        """`forward_extend_mha`'s q [T, H, d_n + d_r], w_uk [H, d_n, r] and w_uv [H, r, d_v]
        must all carry this rank's `num_heads` heads (`check_heads`)."""
        self.check_heads(q, "q")
        for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
            if w.dim() != 3 or w.shape[0] != self.num_heads:
                raise ValueError(
                    f"{type(self).__name__}: {name} {tuple(w.shape)} must have {self.num_heads} "
                    "heads on dim 0, the heads this rank attends"
                )

    def warm_up_tasks(self, act_dtype: torch.dtype) -> list[Callable[[], None]]:
        """The backend's own compiles for before serving, for the layers' `act_dtype`, as
        independent tasks on private tensors (the engine runs them on threads beside its
        start-up: `model/kernel_warm_up.py`, or in order); none by default."""
        return []

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
