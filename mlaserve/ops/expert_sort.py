"""The (token, slot) pairs of a routing grouped by expert: a counting sort in two launches.

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
are seven launches (measured: bench/RESULTS.md, "Session of 2026-11-26 (twelfth)").

The pairs are cut into chunks of BLOCK consecutive pairs, one program each:

    _chunk_hist_kernel   hist[c, e] = pairs of expert e in chunk c          [C, E_PAD] int32
    _place_kernel        from hist: expert e's first position (all pairs of lower experts) plus
                         e's pairs of earlier chunks; the chunk's pairs sorted by (expert, pair)
                         in registers (`tl.sort` of expert * BLOCK + offset: stable) give each
                         pair's rank among its expert's pairs of the chunk

So every pair id is read twice, whatever E (the one-launch form before this, one program per
expert, read them E times).
No host reads: CUDA-graph safe.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["EXPERT_SORT_MAX_PAIRS", "ExpertSort", "sort_by_expert"]

# Up to this many pairs (8192 tokens of V3's top-8) the kernels run; past it torch's sort (the
# placing program's histogram table, [C, E_PAD], grows with the chunks).
EXPERT_SORT_MAX_PAIRS = 65536
# Pairs a program sorts: R over about _CHUNKS, a power of two of at least _MIN_BLOCK and at most
# _MAX_BLOCK, then doubled while the placing programs' histogram table [C_PAD, E_PAD] would pass
# _MAX_TABLE entries. A program's in-register sort grows as BLOCK log^2 BLOCK, its table read as
# C x E (chunk sizes measured: bench/RESULTS.md, "Session of 2026-11-26 (twelfth)", "The sort").
_CHUNKS, _MIN_BLOCK, _MAX_BLOCK, _MAX_TABLE = 64, 128, 512, 16384


class ExpertSort(NamedTuple):
    order: torch.Tensor
    token: torch.Tensor
    pos: torch.Tensor
    counts: torch.Tensor


@triton.jit(do_not_specialize=["num_pairs"])
def _chunk_hist_kernel(
    ids_ptr, hist_ptr, num_pairs, E_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    wait_for_previous_kernel(PDL)
    p = c * BLOCK + tl.arange(0, BLOCK)
    valid = p < num_pairs
    v = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
    tl.store(hist_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.histogram(v, E_PAD, mask=valid))


@triton.jit(do_not_specialize=["num_pairs", "num_chunks"])
def _place_kernel(
    ids_ptr, hist_ptr, order_ptr, token_ptr, pos_ptr, counts_ptr, num_pairs, num_chunks,
    K: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
    C_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    p = c * BLOCK + offs
    # ids are the routing's output, finished before the histogram kernel (this one's
    # predecessor) started: safe to read before the wait
    v = tl.load(ids_ptr + p, mask=p < num_pairs, other=E_PAD).to(tl.int32)  # past R: last
    wait_for_previous_kernel(PDL)
    chunks = tl.arange(0, C_PAD)[:, None]
    bins = tl.arange(0, E_PAD)
    hist = tl.load(hist_ptr + chunks * E_PAD + bins[None, :], mask=chunks < num_chunks, other=0)
    total = tl.sum(hist, 0)  # [E_PAD] pairs per expert
    earlier = tl.sum(tl.where(chunks < c, hist, 0), 0)  # e's pairs in chunks before c
    mine = tl.sum(tl.where(chunks == c, hist, 0), 0)  # e's pairs in chunk c
    # sorted position of the chunk's j-th pair in (expert, pair) order = j + shift[expert]
    shift = (tl.cumsum(total, 0) - total) + earlier - (tl.cumsum(mine, 0) - mine)
    key = tl.sort(v * BLOCK + offs)  # expert-major, then pair order: a stable sort
    e = key // BLOCK
    pair = c * BLOCK + key % BLOCK
    ok = e < E
    at = offs + tl.gather(shift, tl.minimum(e, E_PAD - 1), 0)
    tl.store(order_ptr + at, pair.to(tl.int64), mask=ok)
    tl.store(token_ptr + at, (pair // K).to(tl.int64), mask=ok)
    tl.store(pos_ptr + pair, at, mask=ok)
    if c == 0:
        tl.store(counts_ptr + bins, total, mask=bins < E)


def _chunk_block(num_pairs: int, e_pad: int) -> int:
    """Pairs per chunk for R pairs over E_PAD histogram bins (see `_CHUNKS`)."""
    block = triton.next_power_of_2(triton.cdiv(num_pairs, _CHUNKS))
    block = min(max(block, _MIN_BLOCK), _MAX_BLOCK)
    while triton.next_power_of_2(triton.cdiv(num_pairs, block)) * e_pad > _MAX_TABLE:
        block *= 2
    return block


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
    if num_pairs == 0:
        counts.zero_()
        return ExpertSort(order, token, pos, counts)
    e_pad = triton.next_power_of_2(num_experts)
    block = _chunk_block(num_pairs, e_pad)
    chunks = triton.cdiv(num_pairs, block)
    hist = torch.empty(chunks, e_pad, dtype=torch.int32, device=device)
    pdl = pdl_args(device)
    _chunk_hist_kernel[(chunks,)](ids, hist, num_pairs, E_PAD=e_pad, BLOCK=block, **pdl)
    c_pad = triton.next_power_of_2(chunks)
    _place_kernel[(chunks,)](
        ids, hist, order, token, pos, counts, num_pairs, chunks,
        K=ids.shape[1], E=num_experts, E_PAD=e_pad, BLOCK=block, C_PAD=c_pad,
        num_warps=8 if c_pad * e_pad >= 8192 else 4, **pdl,
    )  # fmt: skip
    return ExpertSort(order, token, pos, counts)
