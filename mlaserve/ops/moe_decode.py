"""A decode-sized MoE layer (routed + shared experts of a few tokens) in three kernels.

    x           [T, H]      bf16 / fp16 / fp32, contiguous
    weights     [T, K]      fp32 routing weights (`routed_scaling_factor` already applied)
    ids         [T, K]      int64 routed expert ids
    w13         [E, 2I, H]  per expert rows [0, I) gate, [I, 2I) up
    w2          [E, H, I]
    shared_w13  [2SI, H]    the shared MLP's merged gate_up: rows [0, SI) gate, [SI, 2SI) up
    shared_w2   [H, SI]
    returns y   [T, H]      x's dtype: sum_k weights[t, k] expert_{ids[t, k]}(x_t) + shared(x_t)

Weights are in the model dtype, or float8_e4m3fn with fp32 block scales (`fp8_linear.py`
layout: `[..., ceil(N/128) or N, ceil(K/128)]`), widened in registers (W8A16: the activations
are never quantised). `moe_weights.MoeDecodeWeights` checks that layout once, after loading.

The shared MLP of width S*I is the sum of S MLPs of width I over consecutive slices of its
intermediate dim, so every (token, slot) pair is one expert of width I: the K routed slots, then
S shared ones with weight 1.

    _gate_up_kernel  grid (T * (K + S), cdiv(I, BLOCK_N)): one pair, BLOCK_N intermediate rows:
                     the gate and up dot products over H, SiLU-and-mul -> h [T * (K + S), I];
                     with `routing`, each routed program first selects its token's experts
                     from the router logits itself (`routing.route_token`)
    _down_kernel     grid (T * (K + S), cdiv(H, BLOCK_N)): one pair, BLOCK_N outputs: the down
                     projection of its h row, weighted -> fp32 partials [T, K + S, H]; with
                     `routing` it selects again itself, and its weight tile loads before its
                     PDL wait (only h is the previous kernel's output), as do the shared
                     slots' tiles in the gate_up kernel: under PDL each kernel's first bytes
                     stream while the kernel before it finishes
    combine          `moe_partials_combine.combine_partials`: each token's K + S partials summed
                     in a fixed order (deterministic, unlike atomics), rounded once -> y

(One program per token looping over its slots in the down kernel would save the partials, but
at small batches too few programs stream the experts: the pairs are faster.)

Why: at decode sizes the MoE is bound by reading the touched experts' weights, and the sorted
grouped-GEMM path (`FusedExperts._forward_sorted`) spends ~15 launches per layer around its two
GEMMs (sort, counts, gather, offsets, SiLU, unsort, weighted sum, the shared MLP's three, the
add) that cost more than the bytes at batch 1. Each pair here is a GEMV (one token), so no
tensor cores and no sorting: programs of one expert that run together share its weights in L2.
Past a few tokens the pairs re-read the same experts and the grouped GEMM wins; the caller
picks by token count (`DeepseekMoE.decode_max_tokens`).

Why the selection inside: at batch 1 the selection kernel is a few microseconds of latency
between the router GEMV and the experts, while recomputing it in every routed program costs a
few reductions over E scores, and the shared slots' programs start streaming their weights
without it.

Rounding follows the unfused path: gate and up outputs rounded to the dtype, SiLU rounded, the
product rounded (h), each routed expert's down output rounded before its weight is applied; the
sum is fp32, rounded once. Launches read no device value on the host: CUDA-graph safe.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.ops.invariant_rowwise import leaf_width
from mlaserve.ops.moe_partials import MoePartials
from mlaserve.ops.moe_partials_combine import combine_partials
from mlaserve.ops.moe_weights import (
    MoeDecodeWeights,
    expert_down_cols,
    expert_gate_up_rows,
    scale_args,
)
from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel
from mlaserve.ops.routing import Routing, route_token

# MoeDecodeWeights, combine_partials, expert_*, scale_args: re-exported (their import path before
# the split into moe_weights / moe_partials_combine).
__all__ = [
    "DecodeTiles",
    "MoeDecodeWeights",
    "combine_partials",
    "decode_tiles",
    "expert_down_cols",
    "expert_gate_up_rows",
    "moe_decode",
    "scale_args",
]


@triton.jit
def _slot_selection(
    t, slot, logits_ptr, bias_ptr, logits_stride, split_stride, scaling,
    SPLITS: tl.constexpr, G: tl.constexpr, PG: tl.constexpr, TOPK_GROUP: tl.constexpr,
    K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_K: tl.constexpr,
    METHOD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """Token t's expert selection from its router logits (`route_token`) and routed slot
    `slot`'s part of it -> (weights [BLOCK_K], ids [BLOCK_K], the slot's weight, its expert).
    Both kernels below select with it: the same code on the same logits, the same bits."""
    sel_w, sel_ids = route_token(
        t, logits_ptr, bias_ptr, logits_stride, split_stride, scaling, SPLITS, G, PG,
        TOPK_GROUP, K, BLOCK_G, BLOCK_PG, BLOCK_K, METHOD, SIGMOID, HAS_BIAS, NORM,
    )  # fmt: skip
    k_idx = tl.arange(0, BLOCK_K)
    weight = tl.sum(tl.where(k_idx == slot, sel_w, 0.0))
    return sel_w, sel_ids, weight, tl.sum(tl.where(k_idx == slot, sel_ids, 0))


@triton.jit
def _tree_rows(offs, routed, index, INTER: tl.constexpr, S: tl.constexpr, CHUNK: tl.constexpr):
    """Intermediate positions `offs` of a pair's h row -> the offsets `expert_gate_up_rows`
    takes. With leaves (CHUNK < INTER) a shared slice's position j = c * CHUNK + k is column
    c * S * CHUNK + index * CHUNK + k of the shared MLP's local intermediate: leaf c holds the
    S slices' CHUNK columns of one S * CHUNK run, as a TP rank's share is one run of the whole
    (the helper adds index * INTER). Identity otherwise, and for routed experts."""
    # one return: Triton types every return of a function, even one a constexpr `if` skips
    if CHUNK == INTER or S == 1:
        out = offs
    else:
        moved = (offs // CHUNK) * (S * CHUNK) + index * (CHUNK - INTER) + offs % CHUNK
        out = tl.where(routed, offs, moved)
    return out


# split_stride (T * E, the logits' split-K stride) is not specialised: one compile for every T
@triton.jit(do_not_specialize=["split_stride"])
def _gate_up_kernel(
    x_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, h_ptr,
    s_e_stride, s_r_stride, ss_r_stride,
    logits_ptr, bias_ptr, logits_stride, split_stride, scaling,
    H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, S: tl.constexpr,
    ROW_DIV: tl.constexpr, SHARED_ROW_DIV: tl.constexpr, HAS_SCALE: tl.constexpr,
    UNIFORM_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr, ROUTE: tl.constexpr, SPLITS: tl.constexpr, G: tl.constexpr, PG: tl.constexpr,
    TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PG: tl.constexpr,
    BLOCK_K_SEL: tl.constexpr, METHOD: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    t = pair // (K + S)
    slot = pair % (K + S)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    routed = slot < K
    # A routed program's expert comes from the previous kernel (the router logits, or the
    # selection's ids): it waits first. A shared slot's weights are constants: its programs
    # issue their first weight loads before the wait (`ops/pdl.py`), so under PDL the shared
    # experts stream while the router's last programs run.
    index = slot - K
    if routed:
        wait_for_previous_kernel(PDL)
        if ROUTE:
            # The token's expert selection, from the router logits: every routed program
            # recomputes it (a few reductions over E scores); the first program of slot 0
            # stores it (the down kernel recomputes it too, before its wait).
            sel_w, sel_ids, _, index = _slot_selection(
                t, slot, logits_ptr, bias_ptr, logits_stride, split_stride, scaling, SPLITS, G,
                PG, TOPK_GROUP, K, BLOCK_G, BLOCK_PG, BLOCK_K_SEL, METHOD, SIGMOID, HAS_BIAS, NORM,
            )  # fmt: skip
            if (slot == 0) & (tl.program_id(1) == 0):
                k_idx = tl.arange(0, BLOCK_K_SEL)
                tl.store(wts_ptr + t * K + k_idx, sel_w, mask=k_idx < K)
                tl.store(ids_ptr + t * K + k_idx, sel_ids, mask=k_idx < K)
        else:
            index = tl.load(ids_ptr + t * K + slot)
    base, gate_rows, up_rows, sbase, sg, su = expert_gate_up_rows(
        routed, index, _tree_rows(offs_n, routed, index, INTER, S, CHUNK), w_ptr, s_ptr, sw_ptr,
        ss_ptr, s_e_stride, s_r_stride, ss_r_stride, INTER, S, ROW_DIV, SHARED_ROW_DIV,
    )  # fmt: skip
    # Each step's weight tiles, x slice and scales are loaded one step ahead (a register double
    # buffer), so a program always has loads in flight.
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = base + gate_rows[:, None] * H + offs_k[None, :]
    u_ptrs = base + up_rows[:, None] * H + offs_k[None, :]
    m = mask_n[:, None] & (offs_k < H)[None, :]
    wg_next = tl.load(g_ptrs, mask=m, other=0.0)
    wu_next = tl.load(u_ptrs, mask=m, other=0.0)
    if UNIFORM_SCALE:
        # Every row of this program lies in one 128-row scale block (BLOCK_N divides 128, the
        # gate and up halves start on block edges): its scales are one per K column block,
        # applied to the x slice instead of to every weight; any BLOCK_K then works (wide
        # steps read each weight row in long runs, which FP8's one-byte rows need).
        n0 = _tree_rows(tl.program_id(1) * BLOCK_N, routed, index, INTER, S, CHUNK)
        _, _, _, _, sg0, su0 = expert_gate_up_rows(
            routed, index, n0, w_ptr, s_ptr, sw_ptr, ss_ptr, s_e_stride, s_r_stride,
            ss_r_stride, INTER, S, ROW_DIV, SHARED_ROW_DIV,
        )  # fmt: skip
        kb = offs_k // 128
        sg_next = tl.load(sbase + sg0 + kb, mask=offs_k < H, other=0.0)
        su_next = tl.load(sbase + su0 + kb, mask=offs_k < H, other=0.0)
    if not routed:
        wait_for_previous_kernel(PDL)  # x is an earlier kernel's output
    x_row = x_ptr + t * H
    x_next = tl.load(x_row + offs_k, mask=offs_k < H, other=0.0)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        wg = wg_next.to(tl.float32)
        wu = wu_next.to(tl.float32)
        xg = x_next.to(tl.float32)
        xu = xg
        nk = k0 + BLOCK_K + offs_k
        m = mask_n[:, None] & (nk < H)[None, :]
        wg_next = tl.load(g_ptrs + k0 + BLOCK_K, mask=m, other=0.0)
        wu_next = tl.load(u_ptrs + k0 + BLOCK_K, mask=m, other=0.0)
        x_next = tl.load(x_row + nk, mask=nk < H, other=0.0)
        if UNIFORM_SCALE:
            xg = xg * sg_next
            xu = xu * su_next
            sg_next = tl.load(sbase + sg0 + nk // 128, mask=nk < H, other=0.0)
            su_next = tl.load(sbase + su0 + nk // 128, mask=nk < H, other=0.0)
        elif HAS_SCALE:  # BLOCK_K divides 128: one scale column per step
            kb = k0 // 128
            wg *= tl.load(sbase + sg + kb, mask=mask_n, other=0.0)[:, None]
            wu *= tl.load(sbase + su + kb, mask=mask_n, other=0.0)[:, None]
        acc_g += tl.sum(wg * xg[None, :], axis=1)
        acc_u += tl.sum(wu * xu[None, :], axis=1)
    dtype = h_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out = act * acc_u.to(dtype).to(tl.float32)
    tl.store(h_ptr + pair * INTER + offs_n, out.to(dtype), mask=mask_n)


@triton.jit(do_not_specialize=["split_stride"])
def _down_kernel(
    h_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, part_ptr,
    s_e_stride, s_r_stride, ss_r_stride,
    logits_ptr, bias_ptr, logits_stride, split_stride, scaling,
    H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, S: tl.constexpr,
    HAS_SCALE: tl.constexpr, UNIFORM_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, TREE: tl.constexpr,
    ROUTE: tl.constexpr, SPLITS: tl.constexpr, G: tl.constexpr, PG: tl.constexpr,
    TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PG: tl.constexpr,
    BLOCK_K_SEL: tl.constexpr, METHOD: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    leaf = tl.program_id(2)  # 0 but with leaves: this leaf's CHUNK positions of h
    t = pair // (K + S)
    slot = pair % (K + S)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    routed = slot < K
    # Only h is the previous kernel's output. The selection is two launches back (the
    # selection kernel's ids and weights; with ROUTE the router logits, recomputed here as the
    # gate_up kernel does) and the weights are constants: all are read before the wait
    # (`ops/pdl.py`), so under PDL a program streams its weight tile while the gate_up
    # kernel's last programs run.
    index = slot - K
    weight = 1.0
    if routed:
        if ROUTE:
            _, _, weight, index = _slot_selection(
                t, slot, logits_ptr, bias_ptr, logits_stride, split_stride, scaling, SPLITS, G,
                PG, TOPK_GROUP, K, BLOCK_G, BLOCK_PG, BLOCK_K_SEL, METHOD, SIGMOID, HAS_BIAS, NORM,
            )  # fmt: skip
        else:
            index = tl.load(ids_ptr + t * K + slot)
            weight = tl.load(wts_ptr + t * K + slot)
    base, row_stride, col0, srow = expert_down_cols(
        routed, index, offs_n, w_ptr, s_ptr, sw_ptr, ss_ptr, s_e_stride, s_r_stride, ss_r_stride,
        H, INTER, S,
    )  # fmt: skip
    # This leaf's columns: [shift, shift + CHUNK) past col0 (`_tree_rows`'s runs for a shared
    # slice); the whole INTER without leaves. FP8: CHUNK is a multiple of 128.
    shift = leaf * CHUNK
    if CHUNK != INTER and S > 1:
        shift = tl.where(routed, shift, leaf * (S * CHUNK) + index * (CHUNK - INTER))
    # As in the gate_up kernel: operands loaded one step ahead, uniform scales on h's slice.
    offs_k = tl.arange(0, BLOCK_K)
    rows = base + offs_n[:, None].to(tl.int64) * row_stride + col0 + shift + offs_k[None, :]
    w_next = tl.load(rows, mask=mask_n[:, None] & (offs_k < CHUNK)[None, :], other=0.0)
    if UNIFORM_SCALE:  # BLOCK_N divides 128: the program's rows share their scale row
        _, _, _, s0 = expert_down_cols(
            routed, index, tl.program_id(1) * BLOCK_N, w_ptr, s_ptr, sw_ptr, ss_ptr, s_e_stride,
            s_r_stride, ss_r_stride, H, INTER, S,
        )  # fmt: skip
        s0 += shift // 128
        s_next = tl.load(s0 + offs_k // 128, mask=offs_k < CHUNK, other=0.0)
    wait_for_previous_kernel(PDL)  # h is the gate_up kernel's output
    h_row = h_ptr + pair * INTER + leaf * CHUNK
    h_next = tl.load(h_row + offs_k, mask=offs_k < CHUNK, other=0.0)
    part = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, CHUNK, BLOCK_K):
        w = w_next.to(tl.float32)
        hk = h_next.to(tl.float32)
        nk = k0 + BLOCK_K + offs_k
        w_next = tl.load(
            rows + k0 + BLOCK_K, mask=mask_n[:, None] & (nk < CHUNK)[None, :], other=0.0
        )
        h_next = tl.load(h_row + nk, mask=nk < CHUNK, other=0.0)
        if UNIFORM_SCALE:
            hk = hk * s_next
            s_next = tl.load(s0 + nk // 128, mask=nk < CHUNK, other=0.0)
        elif HAS_SCALE:
            w *= tl.load(srow + shift // 128 + k0 // 128, mask=mask_n, other=0.0)[:, None]
        part += tl.sum(w * hk[None, :], axis=1)
    if not TREE:  # the unfused expert output; a tree's leaf is a partial sum, kept in fp32
        dtype = h_ptr.dtype.element_ty
        part = tl.where(routed, part.to(dtype).to(tl.float32), part)
    out = part_ptr + (leaf * tl.num_programs(0) + pair) * H + offs_n
    tl.store(out, weight * part, mask=mask_n)


class DecodeTiles(NamedTuple):
    """Tiles of (gate_up, down) and warps per program."""

    block_n: tuple[int, int]
    block_k: tuple[int, int]
    num_warps: int


FP8_RUN = 2048  # the FP8 tiles' column run; layers wider than one run take the wide-layer tiles
WIDE_DOWN_MAX_K = 1024  # the wide-layer down tile's K step: the widest measured (TP2's 1024)


def decode_tiles(
    weights: MoeDecodeWeights, num_tokens: int, leaves: int | None = None
) -> DecodeTiles:
    """The tiles `bench/moe_decode.py --sweep` chose on an H100 (V2-Lite layer, kernels alone):

    - bf16: 16-row tiles of 128 columns, 8 warps at one token, 4 beyond (wider tiles gain
      nothing).
    - FP8 with 128-row block scales: 8 rows of whole 2048-column runs, 4 warps. A one-byte row
      read 128 columns per step is one 128-byte line per row per step: short runs, and per-step
      reductions over half the bytes of a bf16 step.
    - FP8 wider than one FP8_RUN (V3, K2: 7168): gate_up 4 rows of the whole hidden dim in
      one step, down 16 rows of the whole intermediate dim (up to 1024 columns) in one step, 4
      warps: the GEMV's long-K shape (`ops/gemv.py`). One TP2 rank's V3 layer at one token:
      59 us against 74 on the 128-column tiles and 86 on the grouped kernels (floor 48; H200,
      bench/RESULTS.md). The deterministic mode (`leaves`), which runs these kernels at every
      token count, keeps 16-row tiles of 128 columns there: the long-K tiles were measured at
      1-8 tokens only.

    With `leaves` (the deterministic mode's tree, `moe_decode`): the down kernel's K step is at
    most one leaf's width, so it is a function of that width, the same on every TP rank."""
    fp8_blocks = weights.quantized and weights.block_scaled
    if fp8_blocks and weights.hidden > FP8_RUN and leaves is not None:
        tiles = DecodeTiles((16, 16), (128, 128), 4)
    elif fp8_blocks and weights.hidden > FP8_RUN:
        long_k = (triton.next_power_of_2(weights.hidden),
                  min(WIDE_DOWN_MAX_K, triton.next_power_of_2(weights.inter)))  # fmt: skip
        tiles = DecodeTiles((4, 16), long_k, 4)
    elif fp8_blocks:
        wide = (min(FP8_RUN, triton.next_power_of_2(weights.hidden)),
                min(FP8_RUN, triton.next_power_of_2(weights.inter)))  # fmt: skip
        tiles = DecodeTiles((8, 8), wide, 4)
    else:
        tiles = DecodeTiles((16, 16), (128, 128), 8 if num_tokens == 1 else 4)
    if leaves is None:
        return tiles
    leaf = triton.next_power_of_2(weights.inter // leaves)
    return tiles._replace(block_k=(tiles.block_k[0], min(tiles.block_k[1], leaf)))


def moe_decode(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: MoeDecodeWeights,
    *,
    block_n: tuple[int, int] | None = None,
    block_k: tuple[int, int] | None = None,
    num_warps: int | None = None,
    combine: bool = True,
    routing: Routing | None = None,
    leaves: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | MoePartials:
    """x [T, H], topk_weights [T, K] fp32, topk_ids [T, K] int64 -> y [T, H] (x's dtype).
    `block_n` / `block_k`: tiles of (gate_up, down), powers of two. With FP8 weights a block_n
    dividing 128 takes the per-column-block scales onto x's slice, and then any block_k works;
    otherwise (per-row scales, or wider tiles) block_k must divide 128. Defaults (`decode_tiles`)
    from `bench/moe_decode.py --sweep` on an H100, V2-Lite layer. `combine=False` returns the
    per-slot partials uncombined (`MoePartials`), for the next norm to sum.

    `routing`: the expert selection not yet run (`routing.plan_routing` of the router logits),
    then run inside the first kernel, which fills its outputs: topk_weights and topk_ids must be
    `routing.weights` and `routing.ids` (one launch per layer fewer than selecting first).

    `leaves` (the deterministic mode; 1, 2, 4 or 8): the intermediate dim in that many equal
    chunks (of 128s with FP8), the down projection's partials per chunk unrounded, and y is
    the summation tree of `ops/invariant_rowwise.py` over them, each leaf the token's slots
    summed in order (a TP rank's subtree; with S > 1 shared slices a leaf takes one run of the
    shared MLP's intermediate, `_tree_rows`). `out_dtype`: y's dtype (fp32: a rank's unrounded
    share), default x's."""
    if routing is not None and (topk_weights is not routing.weights or topk_ids is not routing.ids):
        raise ValueError("moe_decode: with `routing`, pass its own weights and ids to fill")
    num_tokens, top_k = topk_ids.shape
    hidden, inter, shared = weights.hidden, weights.inter, weights.num_shared
    if x.shape != (num_tokens, hidden) or not x.is_contiguous():
        raise ValueError(f"moe_decode: x {list(x.shape)} vs {num_tokens} tokens x {hidden}")
    tree = leaves is not None
    leaves = 1 if leaves is None else leaves
    chunk = leaf_width(inter, leaves, "moe_decode: intermediate", fp8=weights.quantized)
    if tree and not combine:
        raise ValueError("moe_decode: leaves are combined here (combine=False has no tree)")
    y = torch.empty_like(x, dtype=out_dtype or x.dtype)
    if num_tokens == 0:  # the form of any other count: the next norm under TP takes fp32 parts
        return y if combine else MoePartials.empty(x, top_k + shared)
    pairs = num_tokens * (top_k + shared)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    wts = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    has_scale = weights.quantized
    tiles = decode_tiles(weights, num_tokens, leaves if tree else None)
    block_n = block_n or tiles.block_n
    block_k = block_k or tiles.block_k
    num_warps = num_warps or tiles.num_warps
    uniform = (
        has_scale and weights.block_scaled and 128 % block_n[0] == 0,
        has_scale and 128 % block_n[1] == 0,
    )
    for i in (0, 1):
        if has_scale and not uniform[i] and 128 % block_k[i]:
            raise ValueError(f"moe_decode: block_k {block_k} must divide 128 for these scales")
    pdl = pdl_args(x.device)
    # a missing shared scale's stand-in must be a pointer of the routed scale's type
    s13, s13_e, s13_r = scale_args(weights.w13_scale, weights.w13)
    ss13, _, ss13_r = scale_args(weights.shared_w13_scale, s13)
    if routing is None:  # stand-ins, never read (ROUTE off)
        sel = dict(
            logits_ptr=wts, bias_ptr=wts, logits_stride=0, split_stride=0, scaling=1.0,
            SPLITS=1, G=1, PG=1, TOPK_GROUP=1, BLOCK_G=1, BLOCK_PG=1, BLOCK_K=1, METHOD=0,
            SIGMOID=False, HAS_BIAS=False, NORM=False,
        )  # fmt: skip
    else:  # `route_token`'s arguments; K is the kernel's own
        sel = {k: v for k, v in routing.args.items() if k != "K"}
    sel["BLOCK_K_SEL"] = sel.pop("BLOCK_K")
    _gate_up_kernel[(pairs, triton.cdiv(inter, block_n[0]))](
        x, ids, wts, weights.w13, s13, weights.shared_w13, ss13, h,
        s13_e, s13_r, ss13_r,
        H=hidden, INTER=inter, K=top_k, S=shared,
        ROW_DIV=weights.row_div, SHARED_ROW_DIV=weights.shared_row_div, HAS_SCALE=has_scale,
        UNIFORM_SCALE=uniform[0], BLOCK_N=block_n[0], BLOCK_K=block_k[0], CHUNK=chunk,
        ROUTE=routing is not None, **sel, num_warps=num_warps, **pdl,
    )  # fmt: skip
    s2, s2_e, s2_r = scale_args(weights.w2_scale, weights.w2)
    ss2, _, ss2_r = scale_args(weights.shared_w2_scale, s2)
    part = torch.empty(leaves * pairs, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(pairs, triton.cdiv(hidden, block_n[1]), leaves)](
        h, ids, wts, weights.w2, s2, weights.shared_w2, ss2, part,
        s2_e, s2_r, ss2_r,
        H=hidden, INTER=inter, K=top_k, S=shared, HAS_SCALE=has_scale,
        UNIFORM_SCALE=uniform[1], BLOCK_N=block_n[1], BLOCK_K=block_k[1], CHUNK=chunk,
        TREE=tree, ROUTE=routing is not None, **sel, num_warps=num_warps, **pdl,
    )  # fmt: skip
    if not combine:
        return MoePartials(part.view(num_tokens, top_k + shared, hidden), x.dtype)
    combine_partials(part, y, top_k + shared, leaves)
    return y
