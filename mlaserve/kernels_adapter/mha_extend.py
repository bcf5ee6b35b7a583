"""MHA-form EXTEND (prefill) of MLA: the pure-torch part every `mha_extend` backend shares.

A prefill chunk has many new tokens per sequence, so instead of the absorbed (latent, 576-wide)
form it is cheaper to up-project each sequence's latent context to per-head keys and values and
run a dense causal varlen attention kernel (DeepSeek-V2 section 2.1, the "naive" form):

    k_nope_h = W_UK_h c      v_h = c W_UV_h      K_h = [k_nope_h | k_pe]   (k_pe shared by heads)

With H heads, r = kv_lora_rank, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim, d_v = v_head_dim,
S = the batch's whole context (sum of seq_lens: cached prefix + new tokens of every sequence):

    q       [T, H, d_n + d_r]   the layer's query, not absorbed, RoPE on the last d_r
    latent  [S, r + d_r]        fp32, dequantized from the pool (`gather_context_latent`)
    k       [S, H, d_n + d_r]   in w_uk's dtype (`up_project`)
    v       [S, H, d_v]         in w_uv's dtype
    out     [T, H, d_v]

Rows: sequence b owns query rows `cu_q[b]:cu_q[b+1]` (the batch's token order) and context rows
`cu_kv[b]:cu_kv[b+1]`, its tokens 0..L-1 in order; its q_len new tokens are its last q_len
context rows. Query row i of the sequence sees keys 0 .. L - q_len + i ("bottom-right aligned"
causal mask), which is what makes chunked prefill over a cached prefix exact.

EXTEND batches carry their host lengths (`batch.seq_lens_host`, `batch.q_lens_host`), so the
ragged sizes here come from the host: nothing reads the device. Only context slots (< seq_len)
are gathered, so stale or NaN-poisoned pages are never touched. They run eagerly between
piecewise graphs, except one fresh prompt, whose layout over a token bucket is fixed
(`fresh_layout`) and is captured with the rest of the forward.

`reference_extend_mha` is the whole path in plain torch (CPU or CUDA): the oracle for MHA-form
kernels and what the tests check against the latent-form reference backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mlaserve.engine.forward_batch import ForwardBatch
    from mlaserve.kv_cache.kv_pool import MLAKVPool

__all__ = [
    "ExtendLayout",
    "causal_varlen_attention",
    "extend_layout",
    "fresh_layout",
    "gather_context_latent",
    "mha_context_kv",
    "reference_extend_mha",
    "up_project",
]

# (kv [S, H, d_n + d_v], k_pe [S, d_r], d_n) -> k [S, H, d_n + d_r]: `ops.mha_key.mha_key`
KeyAssembler = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
# (fp8 pool rows [N, r + d_r], slots [S] int64, scale, dtype) -> [S, r + d_r] dequantised:
# `ops.kv_gather.gather_dequant`
LatentGather = Callable[[torch.Tensor, torch.Tensor, float, torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class ExtendLayout:
    """The ragged shape of one EXTEND batch. Host tuples and device int32 prefix sums."""

    q_lens: tuple[int, ...]  # new tokens per sequence
    kv_lens: tuple[int, ...]  # whole context per sequence (cached prefix + new tokens)
    cu_q: torch.Tensor  # [bs + 1] int32, device: query row offsets
    cu_kv: torch.Tensor  # [bs + 1] int32, device: context row offsets
    kv_lens_dev: torch.Tensor  # [bs] int32, device: = kv_lens
    context_slots: torch.Tensor  # [S] int64, device: pool slot of each context row

    @property
    def bs(self) -> int:
        return len(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens, default=0)

    @property
    def num_kv_tokens(self) -> int:
        return sum(self.kv_lens)

    @property
    def all_fresh(self) -> bool:
        """No sequence has a cached prefix (every q_len == kv_len): a top-left causal mask is
        then the same as the bottom-right one."""
        return self.q_lens == self.kv_lens


def extend_layout(batch: ForwardBatch) -> ExtendLayout:
    """The layout of an EXTEND batch: its sizes from the host lengths, its device tensors from
    the batch's own (`seq_lens` are the context lengths, the page table maps them to slots) by
    a few asynchronous device ops. No host-built index array and no copy from the host: this
    runs before a prefill's first kernel, so its host time is the prompt's."""
    if batch.seq_lens_host is None or batch.q_lens_host is None:
        raise ValueError(
            f"{batch.mode.value} batch: the MHA-form prefill needs seq_lens_host and q_lens_host "
            "(EXTEND batches carry them)"
        )
    q_lens, kv_lens = tuple(batch.q_lens_host), tuple(batch.seq_lens_host)
    if len(q_lens) != len(kv_lens) or any(q > k for q, k in zip(q_lens, kv_lens)):
        raise ValueError(f"q_lens_host {q_lens} must fit inside seq_lens_host {kv_lens}")
    if sum(q_lens) != batch.num_tokens:
        raise ValueError(f"q_lens_host sums to {sum(q_lens)}, the batch has {batch.num_tokens}")
    bs, total, page_size = len(kv_lens), sum(kv_lens), batch.kv_pool.page_size
    kv_lens_dev = batch.seq_lens[:bs]
    cu_kv = kv_lens_dev.new_zeros(bs + 1)
    torch.cumsum(kv_lens_dev, 0, out=cu_kv[1:])
    pos = torch.arange(total, device=kv_lens_dev.device)
    if bs == 1:
        pages = batch.block_tables[0][pos // page_size]
    else:  # each context row's sequence; output_size: no host sync for the shape
        seq = torch.repeat_interleave(
            torch.arange(bs, device=pos.device), kv_lens_dev, output_size=total
        )
        pos -= cu_kv[seq]
        pages = batch.block_tables[seq, pos // page_size]
    return ExtendLayout(
        q_lens=q_lens,
        kv_lens=kv_lens,
        cu_q=batch.cu_q_lens[: bs + 1],
        cu_kv=cu_kv,
        kv_lens_dev=kv_lens_dev,
        context_slots=pages.long() * page_size + pos % page_size,
    )


def fresh_layout(slots: torch.Tensor) -> ExtendLayout:
    """The layout of one fresh prompt (no cached prefix) of T = len(slots) rows whose token i
    was written to pool slot `slots[i]` [T] int64: its context is its own rows, so the slots
    it was written to are the slots it reads. Built once per token bucket by the piecewise
    graph runner over its static write-slot buffer: the rows past a real prompt are padding
    (slot 0, the dummy page), which a causal mask keeps from every real row."""
    n, dev = slots.shape[0], slots.device
    lens = torch.tensor([0, n], dtype=torch.int32, device=dev)
    return ExtendLayout(
        q_lens=(n,), kv_lens=(n,), cu_q=lens, cu_kv=lens, kv_lens_dev=lens[1:], context_slots=slots
    )


def gather_context_latent(
    pool: MLAKVPool,
    layer_id: int,
    layout: ExtendLayout,
    dtype: torch.dtype = torch.float32,
    dequant: LatentGather | None = None,
) -> torch.Tensor:
    """[S, r + d_r] in `dtype`: every sequence's context latent, dequantized (value = stored *
    scale). For bf16 the product is rounded once, as fp32-then-cast would (e4m3 -> bf16 is exact
    and torch multiplies bf16 in fp32), without the fp32 copy. `dequant`: a kernel that does an
    fp8 pool's gather, cast and multiply in one launch (`ops.kv_gather`, CUDA); the same bits."""
    flat = pool.kv_buffers[layer_id].view(-1, pool.dim)
    if dequant is not None and pool.is_fp8:
        return dequant(flat, layout.context_slots, pool.k_scales[layer_id], dtype)
    # Index bytes: gathering float8 rows has no kernel on every device.
    rows = (
        flat.view(torch.uint8)[layout.context_slots] if pool.is_fp8 else flat[layout.context_slots]
    )
    rows = rows.view(pool.dtype).to(dtype)
    return rows * pool.k_scales[layer_id] if pool.is_fp8 else rows


def up_project(
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    key: KeyAssembler | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [S, r + d_r]; w_uk [H, d_n, r]; w_uv [H, r, d_v] -> k [S, H, d_n + d_r], v [S, H,
    d_v], computed in the weights' dtype (what a kernel would get from kv_b_proj). `key`: a
    kernel that builds k from the GEMM's per-head rows and k_pe (`ops.mha_key`, CUDA), instead
    of torch's concatenation; the same bits."""
    heads, d_n, rank = w_uk.shape
    c = latent[:, :rank].to(w_uk.dtype)
    k_pe = latent[:, rank:].to(w_uk.dtype)  # [S, d_r], shared by every head
    kv_b = _kv_b_weight(w_uk, w_uv)
    if kv_b is not None:  # one GEMM: [S, r] @ [r, H * (d_n + d_v)]
        kv = (c @ kv_b.T).view(c.shape[0], heads, -1)
        if key is not None:
            return key(kv, k_pe, d_n), kv[..., d_n:]
        k_nope, v = kv[..., :d_n], kv[..., d_n:]
    else:
        k_nope = torch.einsum("sr,hnr->shn", c, w_uk)
        v = torch.einsum("sr,hrv->shv", c, w_uv.to(w_uk.dtype))
    return torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1)], dim=-1), v


def _kv_b_weight(w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor | None:
    """kv_b_proj's weight [H * (d_n + d_v), r] when w_uk / w_uv are the views the model splits
    it into (`MLAAttention.process_weights_after_loading`: per head, d_n rows of W_UK then d_v
    rows of W_UV, w_uv transposed), else None."""
    heads, d_n, rank = w_uk.shape
    w_v = w_uv.transpose(1, 2)  # [H, d_v, r]
    d_v = w_v.shape[1]
    row = (d_n + d_v) * rank
    if (
        w_v.dtype != w_uk.dtype
        or w_v.shape != (heads, d_v, rank)
        or w_uk.stride() != (row, rank, 1)
        or w_v.stride() != (row, rank, 1)
        or w_v.untyped_storage().data_ptr() != w_uk.untyped_storage().data_ptr()
        or w_v.storage_offset() != w_uk.storage_offset() + d_n * rank
    ):
        return None
    return w_uk.as_strided((heads * (d_n + d_v), rank), (rank, 1))


def mha_context_kv(
    layer_id: int,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    batch: ForwardBatch,
    layout: ExtendLayout | None = None,
    key: KeyAssembler | None = None,
    dequant: LatentGather | None = None,
) -> tuple[ExtendLayout, torch.Tensor, torch.Tensor]:
    """Write the new tokens' latent KV to the pool (as `forward` would), then return the layout
    and the per-head K [S, H, d_n + d_r] / V [S, H, d_v] of every sequence's whole context.
    The new tokens are re-read from the pool, so a prefill sees exactly what later decode steps
    will (including fp8 rounding). `layout`: the batch's, if already built (once per forward,
    in `prepare`); built here otherwise. `key`: see `up_project`; `dequant`: see
    `gather_context_latent`."""
    batch.kv_pool.write(layer_id, batch.slot_mapping, kv_c, k_pe)
    if layout is None:
        layout = extend_layout(batch)
    # fp32 latent where the weights are fp32 (the CPU oracle), else straight to their dtype.
    dtype = torch.float32 if w_uk.dtype == torch.float32 else w_uk.dtype
    latent = gather_context_latent(batch.kv_pool, layer_id, layout, dtype, dequant)
    k, v = up_project(latent, w_uk, w_uv, key)
    return layout, k, v


def causal_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ExtendLayout, softmax_scale: float
) -> torch.Tensor:
    """Reference dense attention, fp32: q [T, H, D], k [S, H, D], v [S, H, d_v] -> [T, H, d_v].
    Query row i of a sequence with q_len new tokens and L keys sees keys 0 .. L - q_len + i."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)
    q0 = k0 = 0
    for q_len, kv_len in zip(layout.q_lens, layout.kv_lens):
        qb, kb = q[q0 : q0 + q_len].float(), k[k0 : k0 + kv_len].float()
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * softmax_scale
        last_visible = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        hidden = torch.arange(kv_len, device=q.device)[None, :] > last_visible  # [q, k]
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        out[q0 : q0 + q_len] = torch.einsum("hqk,khv->qhv", probs, v[k0 : k0 + kv_len].float())
        q0, k0 = q0 + q_len, k0 + kv_len
    return out


def reference_extend_mha(
    layer_id: int,
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    batch: ForwardBatch,
    softmax_scale: float,
) -> torch.Tensor:
    """`AttentionBackend.forward_extend_mha` in plain torch: returns [T, H, d_v] in q's dtype.
    A layout the batch carries (`fresh_layout`) is used as it is."""
    given = batch.attn_metadata if isinstance(batch.attn_metadata, ExtendLayout) else None
    layout, k, v = mha_context_kv(layer_id, kv_c, k_pe, w_uk, w_uv, batch, given)
    return causal_varlen_attention(q, k, v, layout, softmax_scale).to(q.dtype)
