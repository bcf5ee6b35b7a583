"""A batched MoE layer (routed + shared experts of tens to hundreds of tokens) in four kernels.

Same contract as `moe_decode` (shapes, dtypes, FP8 scale layout, rounding), for batches past
the few tokens where one GEMV per (token, expert) pair wins: large decode batches and the
k+1-token VERIFY / DRAFT_EXTEND steps of speculative decoding.

    x        [T, H]      bf16 / fp16, contiguous
    weights  [T, K]      fp32 routing weights (`routed_scaling_factor` applied)
    ids      [T, K]      int64 routed expert ids
    y        [T, H]      x's dtype

Every (token, slot) pair is one expert of width I: K routed slots, then the S slices of the
shared MLP as always-selected experts E..E+S-1 with weight 1 (shared experts folded into the
grouped GEMM, the way TensorRT-LLM and SGLang's shared-experts fusion do it).

    _align_kernel     one program: each pair's expert and its rank among the expert's pairs (a
                      routed pair's from an atomic counter per expert, which also gives the
                      counts; a shared expert's pairs are every token in order, ranked by
                      token), every expert's rows padded to a multiple of BLOCK_M and laid out
                      back to back
                      -> slot_pairs [num_blocks * BLOCK_M] int32 (slot -> pair),
                         padded_end [E_PAD] int32 (cumulative padded rows), counts [E_PAD]
                      (the order of a routed expert's pairs varies between runs; no result
                      depends on it: each output row is its own row's dot products over the
                      same K order)
    _gate_up_kernel   grid (num_blocks, cdiv(I, BLOCK_N)): BLOCK_M pairs of one expert gathered
                      from x, gate and up tiles on tensor cores, SiLU-and-mul -> h [pairs, I]
    _down_kernel      grid (num_blocks, cdiv(H, BLOCK_N)): h rows @ the expert's down tile,
                      weighted -> fp32 partials [T, K + S, H]
    combine           `moe_decode`'s: each token's K + S partials in a fixed order -> y

A GEMM block finds its expert from `padded_end` (the experts whose padded rows end at or before
it), so no block -> expert map is written, and blocks past the last expert's rows exit at once.
Each expert's weight tile is read once per BLOCK_M of its rows (the pairs of `moe_decode` read it
once per pair). FP8 weights stay W8A16 (the activations are never quantised), but meet them in
fp16: each activation row of a K step is scaled by a power of two into f16's range, which holds
a bf16 value exactly (`_f16_rows`), so e4m3 -> f16 is the weights' only conversion (one
instruction per two values; e4m3 -> bf16 takes three) and the tensor cores multiply f16. The
products are the bf16 path's, bit for bit; the power of two and the block scale are applied to
each 128-wide K block's fp32 partial sum.

Why not `torch._grouped_mm` plus glue (the path past `max_tokens`): at these sizes the layer is
bound by reading the touched experts' weights, and the sort, gather, SiLU, unsort, weighted sum
and the shared MLP around two grouped GEMMs cost ~20 launches and more time than the bytes.
Launches read no device value on the host, and every constexpr depends on the model and on
the token count's bucket (pairs' power of two, block rows and columns) alone: CUDA-graph safe,
and `moe_grouped_warm_up_tasks` compile every variant at load.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mlaserve.ops.fp8_grouped_gemm import max_expert_blocks
from mlaserve.ops.moe_partials import MoePartials
from mlaserve.ops.moe_partials_combine import combine_partials
from mlaserve.ops.moe_weights import (
    MoeDecodeWeights,
    expert_down_cols,
    expert_gate_up_rows,
    scale_args,
)
from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel
from mlaserve.ops.split_counters import arrive_last, k_splits, release, split_counters
from mlaserve.ops.triton_support import num_sms

__all__ = [
    "MAX_PAIRS",
    "gate_up_split",
    "moe_grouped",
    "moe_grouped_block_m",
    "moe_grouped_warm_up_tasks",
]


@triton.jit
def _align_kernel(
    ids_ptr, slot_pairs_ptr, padded_end_ptr, counts_ptr, rank_ptr, num_pairs,
    K: tl.constexpr, SLOTS: tl.constexpr, E: tl.constexpr, E_TOTAL: tl.constexpr,
    E_PAD: tl.constexpr, NP: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    p = tl.arange(0, NP)
    valid = p < num_pairs
    slot = p % SLOTS
    routed = slot < K
    e = tl.load(ids_ptr + (p // SLOTS) * K + slot, mask=valid & routed, other=0).to(tl.int32)
    e = tl.where(routed, e, E + slot - K)
    bins = tl.arange(0, E_PAD)
    # A shared expert takes every token in order: its rank is the token, its count the tokens,
    # so only the routed pairs count atomically (a shared expert's counter would serialise all
    # T of its pairs on one address).
    shared_bin = (bins >= E) & (bins < E_TOTAL)
    tl.store(rank_ptr + bins, tl.where(shared_bin, num_pairs // SLOTS, 0).to(tl.int32))
    tl.debug_barrier()  # one program: the stores above are visible to all its threads below
    counted = tl.atomic_add(rank_ptr + e, 1, mask=valid & routed)  # rank within its expert
    rank = tl.where(routed, counted, (p // SLOTS).to(tl.int32))
    tl.debug_barrier()
    counts = tl.where(bins < E_TOTAL, tl.load(rank_ptr + bins), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    tl.store(padded_end_ptr + bins, padded_end)
    tl.store(counts_ptr + bins, counts)
    tl.store(rank_ptr + E_PAD + bins, padded_end - padded)  # each expert's first slot
    tl.debug_barrier()
    start = tl.load(rank_ptr + E_PAD + e, mask=valid, other=0)
    tl.store(slot_pairs_ptr + start + rank, p, mask=valid)


@triton.jit
def _f16_rows(a):
    """a [M, K] bf16 -> (f16 [M, K], fp32 scale [M]) with a == f16 * scale exactly: each row
    scaled by a power of two that puts its max magnitude in [2^14, 2^15) (a bf16's 8 significant
    bits fit f16's 11; only values 2^28 below the row's max lose bits, as f16 subnormals)."""
    a32 = a.to(tl.float32)
    e = (tl.max(tl.abs(a32), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, 15)  # a zero row stays zero under any scale
    inv = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2^(141 - e)
    scale = ((e - 14) << 23).to(tl.float32, bitcast=True)  # 2^(e - 141)
    return (a32 * inv[:, None]).to(tl.float16), scale


@triton.jit
def _block_rows(
    slot_pairs_ptr, padded_end_ptr, counts_ptr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr
):
    """-> (expert, pairs [BLOCK_M], ok [BLOCK_M], live) of this program's block of slots."""
    start = tl.program_id(0) * BLOCK_M
    bins = tl.arange(0, E_PAD)
    padded_end = tl.load(padded_end_ptr + bins)
    e = tl.sum((padded_end <= start).to(tl.int32))  # the expert whose padded rows hold `start`
    live = start < tl.max(padded_end)
    first = tl.max(tl.where(bins < e, padded_end, 0))  # its first slot
    n_e = tl.sum(tl.where(bins == e, tl.load(counts_ptr + bins), 0))
    ok = (start - first + tl.arange(0, BLOCK_M) < n_e) & live
    pairs = tl.load(slot_pairs_ptr + start + tl.arange(0, BLOCK_M), mask=ok, other=0)
    return e, pairs, ok, live


@triton.jit
def _gate_up_kernel(
    x_ptr, slot_pairs_ptr, padded_end_ptr, counts_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, h_ptr,
    ws_ptr, cnt_ptr, s_e_stride, s_r_stride, ss_r_stride, num_slots,
    H: tl.constexpr, INTER: tl.constexpr, SLOTS: tl.constexpr, E: tl.constexpr,
    S: tl.constexpr, E_PAD: tl.constexpr, ROW_DIV: tl.constexpr, SHARED_ROW_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, K_PER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    e32, pairs, ok, live = _block_rows(slot_pairs_ptr, padded_end_ptr, counts_ptr, E_PAD, BLOCK_M)
    if live:
        e = e32.to(tl.int64)
        tok = (pairs // SLOTS).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < INTER
        routed = e < E  # else shared slice e - E
        base, gate_rows, up_rows, sbase, sg, su = expert_gate_up_rows(
            routed, tl.where(routed, e, e - E), offs_n, w_ptr, s_ptr, sw_ptr, ss_ptr,
            s_e_stride, s_r_stride, ss_r_stride, INTER, S, ROW_DIV, SHARED_ROW_DIV,
        )  # fmt: skip
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # this split's whole scale blocks; 0 unsplit (a constant: the loop compiles as before)
        k_lo = tl.program_id(2) * K_PER if SPLIT > 1 else 0
        for k in range(0, K_PER, BLOCK_K):  # constant bounds: pipelined as before the split
            k0 = k_lo + k
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < H
            a = tl.load(
                x_ptr + tok[:, None] * H + offs_k[None, :],
                mask=ok[:, None] & mask_k[None, :],
                other=0.0,
            )
            m = mask_k[:, None] & mask_n[None, :]
            wg = tl.load(base + gate_rows[None, :] * H + offs_k[:, None], mask=m, other=0.0)
            wu = tl.load(base + up_rows[None, :] * H + offs_k[:, None], mask=m, other=0.0)
            if HAS_SCALE:  # BLOCK_K divides 128: one scale column per step
                a16, a_scale = _f16_rows(a)
                kb = k0 // 128
                sg_k = tl.load(sbase + sg + kb, mask=mask_n, other=0.0)
                su_k = tl.load(sbase + su + kb, mask=mask_n, other=0.0)
                acc_g += tl.dot(a16, wg.to(tl.float16)) * (a_scale[:, None] * sg_k[None, :])
                acc_u += tl.dot(a16, wu.to(tl.float16)) * (a_scale[:, None] * su_k[None, :])
            else:
                acc_g += tl.dot(a, wg)
                acc_u += tl.dot(a, wu)
        m = ok[:, None] & mask_n[None, :]
        if SPLIT == 1:
            _silu_mul_store(acc_g, acc_u, h_ptr, pairs, offs_n, m, INTER)
        else:  # park the partial sums; the tile's last split to arrive adds them up in order
            slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
            rows = (slots[:, None] * 2 * INTER + offs_n[None, :]).to(tl.int64)
            part = ws_ptr + tl.program_id(2).to(tl.int64) * num_slots * 2 * INTER + rows
            tl.store(part, acc_g, mask=m)
            tl.store(part + INTER, acc_u, mask=m)
            tile = cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if arrive_last(tile, SPLIT):
                acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for sp in tl.static_range(SPLIT):
                    part = ws_ptr + sp * num_slots * 2 * INTER + rows
                    acc_g += tl.load(part, mask=m, other=0.0, cache_modifier=".cg")
                    acc_u += tl.load(part + INTER, mask=m, other=0.0, cache_modifier=".cg")
                _silu_mul_store(acc_g, acc_u, h_ptr, pairs, offs_n, m, INTER)
                release(tile)


@triton.jit
def _silu_mul_store(acc_g, acc_u, h_ptr, pairs, offs_n, m, INTER: tl.constexpr):
    """h[pairs, offs_n] = SiLU(gate) * up, each rounded to h's dtype as the torch MLP rounds."""
    dtype = h_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out = act * acc_u.to(dtype).to(tl.float32)
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * INTER + offs_n[None, :]
    tl.store(h_ptrs, out.to(dtype), mask=m)


@triton.jit
def _down_kernel(
    h_ptr, slot_pairs_ptr, padded_end_ptr, counts_ptr, wts_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr,
    part_ptr, s_e_stride, s_r_stride, ss_r_stride,
    H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, SLOTS: tl.constexpr, E: tl.constexpr,
    S: tl.constexpr, E_PAD: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    e32, pairs32, ok, live = _block_rows(slot_pairs_ptr, padded_end_ptr, counts_ptr, E_PAD, BLOCK_M)
    if live:
        e = e32.to(tl.int64)
        pairs = pairs32.to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        routed = e < E
        base, row_stride, col0, srow = expert_down_cols(
            routed, tl.where(routed, e, e - E), offs_n, w_ptr, s_ptr, sw_ptr, ss_ptr,
            s_e_stride, s_r_stride, ss_r_stride, H, INTER, S,
        )  # fmt: skip
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < INTER
            a = tl.load(
                h_ptr + pairs[:, None] * INTER + offs_k[None, :],
                mask=ok[:, None] & mask_k[None, :],
                other=0.0,
            )
            w = tl.load(
                base + offs_n[None, :].to(tl.int64) * row_stride + col0 + offs_k[:, None],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            if HAS_SCALE:
                a16, a_scale = _f16_rows(a)
                w_k = tl.load(srow + k0 // 128, mask=mask_n, other=0.0)
                acc += tl.dot(a16, w.to(tl.float16)) * (a_scale[:, None] * w_k[None, :])
            else:
                acc = tl.dot(a, w, acc)
        slot = pairs % SLOTS
        tok = pairs // SLOTS
        weight = tl.load(wts_ptr + tok * K + tl.minimum(slot, K - 1), mask=ok & routed, other=1.0)
        dtype = h_ptr.dtype.element_ty
        if routed:  # the unfused path rounds each routed expert's output before weighting it
            acc = acc.to(dtype).to(tl.float32)
        part_ptrs = part_ptr + pairs[:, None] * H + offs_n[None, :]
        tl.store(part_ptrs, weight[:, None] * acc, mask=ok[:, None] & mask_n[None, :])


# The align kernel holds every (token, slot) pair in one program: tested to 4096 pairs (512
# tokens x 8 slots, tests/ops/test_moe_grouped.py); 9 million (a switch set to a million tokens)
# ended in an illegal memory access on an H200.
MAX_PAIRS = 4096


def moe_grouped_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per GEMM block: 16 (tl.dot's minimum) while experts get a few rows each, larger
    where they get more, so an expert's weights are read fewer times."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 24 else (32 if per_expert <= 48 else 64)


# The gate / up GEMM's K split: a rank's narrow experts (V3's at TP4 / TP8: 512 / 256 wide) give
# a few-token batch too few (block, column) tiles to fill the SMs, each walking all of H. Only
# grids under SPLIT_BELOW programs an SM split: between it and a full wave a split lost 7-11 %
# (TP4 at 5-7 tokens, TP8 at 12, TP2 at 3; below it the split won 4-24 %, H200, bench/RESULTS.md,
# fortieth session).
SPLIT_BELOW = 2.5
SPLIT_PROGRAMS_PER_SM = 4  # split until the grid holds about this many programs per SM
MAX_SPLIT = 8
MIN_SPLIT_K = 1024  # keys per split at least (8 scale blocks): shorter ones add more than they read


def gate_up_split(tiles: int, hidden: int, num_sms: int) -> int:
    """K splits of the gate / up GEMM for a grid of `tiles` (blocks x column tiles, the blocks
    counted at `max_expert_blocks`' bound): 1 where the tiles make SPLIT_BELOW programs an SM
    or more, else as many as bring the grid toward SPLIT_PROGRAMS_PER_SM, at most MAX_SPLIT and
    with splits of at least MIN_SPLIT_K keys, lowered until it divides H's 128-wide blocks (so
    every split walks the same whole blocks; an H off that grid never splits):
    `split_counters.k_splits`."""
    return k_splits(tiles, hidden, num_sms, split_below=SPLIT_BELOW,
                    programs_per_sm=SPLIT_PROGRAMS_PER_SM, max_split=MAX_SPLIT,
                    min_split_k=MIN_SPLIT_K)  # fmt: skip


def _num_pairs_bucket(num_pairs: int) -> int:
    return max(16, triton.next_power_of_2(num_pairs))


def _align_warps(num_pairs: int) -> int:
    """The align kernel's warps: one program holds every pair, so more pairs get more threads
    (each thread's atomics are issued one after another)."""
    return 4 if num_pairs <= 256 else (8 if num_pairs <= 1024 else 16)


def moe_grouped(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: MoeDecodeWeights,
    *,
    block_m: int | None = None,
    block_n: tuple[int, int] | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    split: int | None = None,
    combine: bool = True,
) -> torch.Tensor | MoePartials:
    """x [T, H], topk_weights [T, K] fp32, topk_ids [T, K] int64 -> y [T, H] (x's dtype).
    `block_m` overrides `moe_grouped_block_m` (tests); `block_n` the tiles of (gate_up, down),
    `block_k` the K step (with FP8 it must divide 128), `num_stages` the pipeline depth; by
    default the tiles `bench/moe_decode.py --sweep` measured best (V2-Lite layer, 8-256
    tokens; bench/RESULTS.md): FP8 (64, 128) x 128, 3 stages; bf16 (64, 64) x 128 in 4 stages
    up to 128 tokens, x 64 in 3 beyond. `split` overrides `gate_up_split` (the gate / up
    GEMM's K split). `combine=False` returns the per-slot partials uncombined (`MoePartials`)."""
    num_tokens, top_k = topk_ids.shape
    hidden, inter, shared = weights.hidden, weights.inter, weights.num_shared
    if x.shape != (num_tokens, hidden) or not x.is_contiguous():
        raise ValueError(f"moe_grouped: x {list(x.shape)} vs {num_tokens} tokens x {hidden}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"moe_grouped: x must be bf16 or fp16 (tensor cores), got {x.dtype}")
    y = torch.empty_like(x)
    if num_tokens == 0:  # the form of any other count: the next norm under TP takes fp32 parts
        return y if combine else MoePartials.empty(x, top_k + shared)
    slots = top_k + shared
    num_experts = weights.w13.shape[0]
    e_total = num_experts + shared
    e_pad = triton.next_power_of_2(e_total)
    pairs = num_tokens * slots
    if pairs > MAX_PAIRS:
        raise ValueError(f"moe_grouped: {num_tokens} tokens x {slots} slots = {pairs} pairs > "
                         f"MAX_PAIRS = {MAX_PAIRS}: the sorted path serves batches this large")  # fmt: skip
    bm = block_m or moe_grouped_block_m(pairs, e_total)
    num_blocks = max_expert_blocks(pairs, e_total, bm)
    # int32 scratch: slot -> pair, padded ends, counts, the align kernel's counters and starts
    scratch = torch.empty(num_blocks * bm + 4 * e_pad, dtype=torch.int32, device=x.device)
    slot_pairs = scratch[: num_blocks * bm]
    padded_end, counts = scratch[num_blocks * bm :].view(4, e_pad)[:2]
    rank = scratch[num_blocks * bm + 2 * e_pad :]
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    wts = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    pdl = pdl_args(x.device)
    _align_kernel[(1,)](
        ids, slot_pairs, padded_end, counts, rank, pairs,
        K=top_k, SLOTS=slots, E=num_experts, E_TOTAL=e_total, E_PAD=e_pad,
        NP=_num_pairs_bucket(pairs), BLOCK_M=bm, num_warps=_align_warps(pairs), **pdl,
    )  # fmt: skip
    has_scale = weights.quantized
    small = num_tokens <= 128
    if block_n is None:
        block_n = (64, 128) if has_scale else (64, 64)
    block_k = block_k or (128 if has_scale or small else 64)
    num_stages = num_stages or (3 if has_scale or not small else 4)
    if has_scale and 128 % block_k:
        raise ValueError(f"moe_grouped: block_k {block_k} must divide 128 for FP8 block scales")
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    s13, s13_e, s13_r = scale_args(weights.w13_scale, weights.w13)
    ss13, _, ss13_r = scale_args(weights.shared_w13_scale, s13)
    n_tiles = triton.cdiv(inter, block_n[0])
    if split is None:
        split = gate_up_split(num_blocks * n_tiles, hidden, num_sms(x.device))
    if split > 1 and hidden % (128 * split):
        raise ValueError(
            f"moe_grouped: split {split} does not divide H {hidden} in 128-wide blocks"
        )
    k_per = hidden // split
    if split > 1:  # fp32 partials of the live rows, and the per-tile arrival counters
        ws = torch.empty(split, num_blocks * bm, 2 * inter, dtype=torch.float32, device=x.device)
        cnt = split_counters(x.device, num_blocks * n_tiles)
    else:
        ws = cnt = h  # unused
    _gate_up_kernel[(num_blocks, n_tiles, split)](
        x, slot_pairs, padded_end, counts, weights.w13, s13, weights.shared_w13, ss13, h,
        ws, cnt, s13_e, s13_r, ss13_r, num_blocks * bm,
        H=hidden, INTER=inter, SLOTS=slots, E=num_experts, S=shared, E_PAD=e_pad,
        ROW_DIV=weights.row_div, SHARED_ROW_DIV=weights.shared_row_div, HAS_SCALE=has_scale,
        BLOCK_M=bm, BLOCK_N=block_n[0], BLOCK_K=block_k, SPLIT=split, K_PER=k_per,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )  # fmt: skip
    s2, s2_e, s2_r = scale_args(weights.w2_scale, weights.w2)
    ss2, _, ss2_r = scale_args(weights.shared_w2_scale, s2)
    part = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n[1]))](
        h, slot_pairs, padded_end, counts, wts, weights.w2, s2, weights.shared_w2, ss2, part,
        s2_e, s2_r, ss2_r,
        H=hidden, INTER=inter, K=top_k, SLOTS=slots, E=num_experts, S=shared, E_PAD=e_pad,
        HAS_SCALE=has_scale, BLOCK_M=bm, BLOCK_N=block_n[1], BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )  # fmt: skip
    if not combine:  # the next norm sums them (`ops.rms_norm.add_partials_rms_norm`)
        return MoePartials(part.view(num_tokens, slots, hidden), x.dtype)
    combine_partials(part, y, slots)
    return y


def moe_grouped_warm_up_tasks(
    weights: MoeDecodeWeights, top_k: int, min_tokens: int, max_tokens: int, dtype: torch.dtype
) -> list[Callable[[], None]]:
    """Tasks that together run one batch of every compiled variant between min_tokens and
    max_tokens (the pairs' power-of-two bucket, the block rows and columns, Triton's
    divisibility specialisation), so nothing compiles while serving. Batches that share the
    GEMMs' variant (block rows, and the block_k / stages choice) are one task, in order: on
    threads, two batches reaching one variant at once would both compile it. Tasks are
    independent."""
    slots = top_k + weights.num_shared
    e_total = weights.w13.shape[0] + weights.num_shared
    seen, groups = set(), {}
    for t in range(min_tokens, max_tokens + 1):
        pairs = t * slots  # Triton also specialises the align kernel on pairs % 16 == 0
        gemms = (moe_grouped_block_m(pairs, e_total), t <= 128)  # t: default block_k, stages
        key = (_num_pairs_bucket(pairs), pairs % 16 == 0, *gemms)
        if key not in seen:
            seen.add(key)
            groups.setdefault(gemms, []).append(t)
    return [
        functools.partial(_grouped_batches, counts, weights, top_k, dtype)
        for counts in groups.values()
    ]


def _grouped_batches(
    counts: list[int], weights: MoeDecodeWeights, top_k: int, dtype: torch.dtype
) -> None:
    """One batch of zeros of each token count in `counts`, in order."""
    device = weights.w13.device
    for t in counts:
        x = torch.zeros(t, weights.hidden, dtype=dtype, device=device)
        ids = torch.arange(t * top_k, device=device).view(t, top_k) % weights.w13.shape[0]
        moe_grouped(x, torch.zeros(t, top_k, device=device), ids, weights)
