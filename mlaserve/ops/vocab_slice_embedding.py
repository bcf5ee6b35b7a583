"""A tensor-parallel rank's share of a token embedding: the rows of its vocabulary slice, zero
rows for the ids other ranks hold (an all-reduce then sums exactly one non-zero row per token).

    ids     [T] int64, any token id (< the vocabulary)
    weight  [R, H] bf16 / fp16 / fp32, contiguous: rows [start, start + R) of the padded table
    out     [T, H] weight's dtype, contiguous: weight[ids - start] where start <= id < start + R,
            else zeros

One kernel where the torch reference (`model/layers/embedding.py: slice_lookup`: shift, two
compares, and, two masked fills around the lookup) launches eight; the same bits (a copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["vocab_slice_embedding"]


@triton.jit
def _vocab_slice_embedding_kernel(
    ids_ptr, w_ptr, out_ptr, start, rows, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    wait_for_previous_kernel(PDL)  # the ids come from the kernel before (the inputs' fill)
    local = tl.load(ids_ptr + t) - start
    mine = (local >= 0) & (local < rows)
    row = tl.where(mine, local, 0)
    x = tl.load(w_ptr + row * HIDDEN + offs, mask=mask & mine, other=0.0)
    tl.store(out_ptr + t * HIDDEN + offs, x, mask=mask)


def vocab_slice_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """[T] int64 ids, [R, H] weight (rows start .. start + R - 1) -> [T, H]."""
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(
            f"vocab_slice_embedding: ids must be [T] int64, got {ids.shape} {ids.dtype}"
        )
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"vocab_slice_embedding: weight must be a contiguous [R, H], got {weight.shape}"
        )
    rows, hidden = weight.shape
    out = torch.empty(ids.shape[0], hidden, dtype=weight.dtype, device=weight.device)
    if ids.shape[0] == 0:
        return out
    block = min(triton.next_power_of_2(hidden), 2048)
    _vocab_slice_embedding_kernel[(ids.shape[0], triton.cdiv(hidden, block))](
        ids.contiguous(), weight, out, start, rows, HIDDEN=hidden, BLOCK=block, num_warps=4,
        **pdl_args(weight.device),
    )  # fmt: skip
    return out
