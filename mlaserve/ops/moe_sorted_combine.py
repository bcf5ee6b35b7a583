"""The last step of the sorted MoE path (prefill-sized batches): expert-sorted rows back to tokens.

The sorted path (`FusedExperts._forward_sorted`) runs the routed experts over the (token, slot)
pairs grouped by expert. Its output rows are in that sorted order; each token wants the
weighted sum of its K rows, plus the shared experts' output:

    rows     [T*K, H]  bf16 / fp16 / fp32, contiguous: row i is pair order[i]'s expert output
    order    [T*K]     int64: the sorted position -> pair (pair p = token p // K, slot p % K)
    weights  [T, K]    fp32 routing weights (`routed_scaling_factor` applied)
    shared   [T, H]    rows' dtype (or fp32), optional, contiguous
    y        [T, H]    rows' dtype (or fp32: no rounding):
                       y = round(sum_k weights[t, k] * rows[pos(t, k)]) (+ shared)

where pos = order's inverse. The sum runs in fp32 over k = 0..K-1 in order and is rounded
once; adding `shared` is a second rounding, as the torch reference's `y + shared` is.

Two kernels replace the torch reference's unsort (`index_copy_`), fp32 upcast, broadcast
multiply, sum, downcast and add (six launches and ~200 MB of fp32 temporaries written and read
per 2048-token layer at the V2-Lite shape):

    _invert_kernel    pos[order[i]] = i            (T*K int32 writes; skipped when the caller
                      has `pos` from `ops.expert_sort`, which writes it while sorting)
    _combine_kernel   grid (T, cdiv(H, BLOCK)): one token's K rows, weighted, summed

Launches read no device value on the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["combined_token_row", "moe_sorted_combine"]


@triton.jit(do_not_specialize=["n"])  # one compile for every pair count (warm-up covers it)
def _invert_kernel(order_ptr, pos_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    pair = tl.load(order_ptr + i, mask=mask, other=0)
    tl.store(pos_ptr + pair, i.to(tl.int32), mask=mask)


@triton.jit
def combined_token_row(
    rows_ptr, row_stride, pos_ptr, weights_ptr, shared_ptr, t, cols, mask,
    H: tl.constexpr, K: tl.constexpr, HAS_SHARED: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """Token t's combined output at `cols`, in DTYPE: round(sum over k = 0..K-1, in order, of
    weights[t, k] * rows[pos[t*K + k], cols]), then + shared[t, cols] rounded again. The
    combine kernel's and `ops.rms_norm`'s (which fuses it): one place for its roundings."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(pos_ptr + t * K + k).to(tl.int64)
        w = tl.load(weights_ptr + t * K + k)
        acc += tl.load(rows_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32) * w
    y = acc.to(DTYPE)
    if HAS_SHARED:
        shared = tl.load(shared_ptr + t * H + cols, mask=mask, other=0.0)
        y = (y.to(tl.float32) + shared.to(tl.float32)).to(DTYPE)
    return y


@triton.jit
def _combine_kernel(
    rows_ptr, pos_ptr, weights_ptr, shared_ptr, y_ptr,
    H: tl.constexpr, K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    y = combined_token_row(
        rows_ptr, H, pos_ptr, weights_ptr, shared_ptr, t, cols, mask,
        H, K, HAS_SHARED, y_ptr.dtype.element_ty,
    )  # fmt: skip
    tl.store(y_ptr + t * H + cols, y, mask=mask)


def moe_sorted_combine(
    rows: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    *,
    pos: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """rows [T*K, H] (sorted by expert), order [T*K], weights [T, K] fp32, shared [T, H] (rows'
    dtype, or fp32) or None -> y [T, H] in `out_dtype` (default rows' dtype; fp32: neither sum
    rounded, a tensor-parallel rank's share). `pos`: order's inverse [T*K] int32, if the caller
    has it (`ops.expert_sort`); else one launch computes it."""
    num_tokens, top_k = weights.shape
    num_pairs, hidden = rows.shape
    if num_pairs != num_tokens * top_k or order.shape != (num_pairs,):
        raise ValueError(
            f"moe_sorted_combine: rows {list(rows.shape)} and order {list(order.shape)} must "
            f"hold T*K = {num_tokens * top_k} pairs"
        )
    if weights.dtype != torch.float32 or not rows.is_contiguous():
        raise ValueError("moe_sorted_combine: weights must be fp32 and rows contiguous")
    if shared is not None and (shared.shape != (num_tokens, hidden) or not shared.is_contiguous()):
        raise ValueError(f"moe_sorted_combine: shared must be contiguous [{num_tokens}, {hidden}]")
    y = torch.empty(num_tokens, hidden, dtype=out_dtype or rows.dtype, device=rows.device)
    if num_tokens == 0:
        return y
    if pos is None:
        pos = torch.empty(num_pairs, dtype=torch.int32, device=rows.device)
        block = 1024
        _invert_kernel[(triton.cdiv(num_pairs, block),)](order, pos, num_pairs, BLOCK=block)
    elif pos.shape != (num_pairs,) or pos.dtype != torch.int32:
        raise ValueError(f"moe_sorted_combine: pos must be int32 [{num_pairs}]")
    block = min(triton.next_power_of_2(hidden), 1024)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        rows, pos, weights.contiguous(), shared if shared is not None else rows, y,
        H=hidden, K=top_k, HAS_SHARED=shared is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return y
