"""The (token, slot) pairs of a routing grouped by expert, in one launch: a counting sort.

    ids     [T, K] int (any integer dtype), contiguous: each token's routed experts, all < E
    returns ExpertSort:
      order   [R] int64, R = T * K: sorted position -> pair (pair p = token p // K, slot p % K)
      token   [R] int64: order // K, the token whose row of x goes to each sorted position
      pos     [R] int32: pair -> sorted position (order's inverse)
      counts  [E] int32: pairs per expert; expert e owns positions
              [sum(counts[:e]), sum(counts[:e + 1]))

`order` is `torch.argsort(ids.flatten(), stable=True)`: within an expert the pairs keep their
order. Why not that (the CPU path's, and past EXPERT_SORT_MAX_PAIRS): torch's radix sort over
uint8 keys, the counts by `scatter_add_`, the token division and `moe_sorted_combine`'s inversion
are seven launches, ~30 us of a 2048-token V2-Lite layer on an H100, where this is one launch of
~15 us. One program per expert reads all R ids twice (from L2: 98 KB at 2048 tokens of top-6):
the pairs of lower experts give its first position, then a running prefix sum ranks its own
pairs. No host reads: CUDA-graph safe.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["EXPERT_SORT_MAX_PAIRS", "ExpertSort", "sort_by_expert"]

# Up to this many pairs (4096 tokens of top-6) the kernel beats torch's sort; past it torch's
# radix sort wins: its time is nearly flat, this kernel's grows with the pairs each program
# reads (H100, us, torch / this: 29.2 / 8.4 at 6144 pairs, 30.1 / 14.8 at 12288, 33.0 / 27.1
# at 24576; bench/moe_prefill.py --glue).
EXPERT_SORT_MAX_PAIRS = 24576

# Pairs a program holds per step; past that the steps loop, their count a power of two (one
# compiled variant per bucket, not per size: steps past the last pair load nothing).
_MAX_BLOCK = 4096


class ExpertSort(NamedTuple):
    order: torch.Tensor
    token: torch.Tensor
    pos: torch.Tensor
    counts: torch.Tensor


@triton.jit(do_not_specialize=["num_pairs"])
def _sort_kernel(
    ids_ptr, order_ptr, token_ptr, pos_ptr, counts_ptr, num_pairs,
    K: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    wait_for_previous_kernel(PDL)
    offs = tl.arange(0, BLOCK)
    before = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(CHUNKS):
        p = i * BLOCK + offs
        v = tl.load(ids_ptr + p, mask=p < num_pairs, other=e)
        before += (v < e).to(tl.int32)
    first = tl.sum(before)
    placed = first
    for i in range(CHUNKS):
        p = i * BLOCK + offs
        mine = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1) == e
        rank = tl.cumsum(mine.to(tl.int32), 0)
        at = placed + rank - 1
        tl.store(order_ptr + at, p.to(tl.int64), mask=mine)
        tl.store(token_ptr + at, (p // K).to(tl.int64), mask=mine)
        tl.store(pos_ptr + p, at, mask=mine)
        placed += tl.sum(mine.to(tl.int32))
    tl.store(counts_ptr + e, placed - first)


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertSort:
    """ids [T, K] -> ExpertSort (see the module docstring)."""
    if ids.dim() != 2 or ids.dtype.is_floating_point or not ids.is_contiguous():
        raise ValueError(f"sort_by_expert: need contiguous integer ids [T, K], got {ids.dtype}")
    num_pairs = ids.numel()
    device = ids.device
    order = torch.empty(num_pairs, dtype=torch.int64, device=device)
    token = torch.empty(num_pairs, dtype=torch.int64, device=device)
    pos = torch.empty(num_pairs, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    block = min(max(triton.next_power_of_2(num_pairs), 128), _MAX_BLOCK)
    chunks = triton.next_power_of_2(triton.cdiv(num_pairs, block))
    _sort_kernel[(num_experts,)](
        ids, order, token, pos, counts, num_pairs,
        K=ids.shape[1], BLOCK=block, CHUNKS=chunks, num_warps=4 if block <= 1024 else 8,
        **pdl_args(device),
    )  # fmt: skip
    return ExpertSort(order, token, pos, counts)
