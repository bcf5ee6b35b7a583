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
are never quantised).

The shared MLP of width S*I is the sum of S MLPs of width I over consecutive slices of its
intermediate dim, so every (token, slot) pair is one expert of width I: the K routed slots, then
S shared ones with weight 1.

    _gate_up_kernel  grid (T * (K + S), cdiv(I, BLOCK_N)): one pair, BLOCK_N intermediate rows:
                     the gate and up dot products over H, SiLU-and-mul -> h [T * (K + S), I]
    _down_kernel     grid (T * (K + S), cdiv(H, BLOCK_N)): one pair, BLOCK_N outputs: the down
                     projection of its h row, weighted -> fp32 partials [T, K + S, H]
    _combine_kernel  grid (T, cdiv(H, 1024)): each token's K + S partials summed in a fixed order
                     (deterministic, unlike atomics), rounded once -> y

(One program per token looping over its slots in the down kernel would save the partials, but
at batch 1 that is 128 programs streaming 8 experts each: 5x slower than the pairs on an H100.)

Why: at decode sizes the MoE is bound by reading the touched experts' weights, and the sorted
grouped-GEMM path (`FusedExperts._forward_sorted`) spends ~15 launches per layer around its two
GEMMs (sort, counts, gather, offsets, SiLU, unsort, weighted sum, the shared MLP's three, the
add) that cost more than the bytes at batch 1. Each pair here is a GEMV (one token), so no
tensor cores and no sorting: programs of one expert that run together share its weights in L2.
Past a few tokens the pairs re-read the same experts and the grouped GEMM wins; the caller
picks by token count (`DeepseekMoE.decode_max_tokens`).

Rounding follows the unfused path: gate and up outputs rounded to the dtype, SiLU rounded, the
product rounded (h), each routed expert's down output rounded before its weight is applied; the
sum is fp32, rounded once. Launches read no device value on the host: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.moe_partials import MoePartials
from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = [
    "MoeDecodeWeights",
    "combine_partials",
    "expert_down_cols",
    "expert_gate_up_rows",
    "moe_decode",
    "scale_args",
]

_SCALE_BLOCK = 128  # the FP8 block size along K (both GEMMs)


@triton.jit
def expert_gate_up_rows(
    routed, index, offs_n, w_ptr, s_ptr, sw_ptr, ss_ptr, s_e_stride, s_r_stride, ss_r_stride,
    INTER: tl.constexpr, S: tl.constexpr, ROW_DIV: tl.constexpr, SHARED_ROW_DIV: tl.constexpr,
):  # fmt: skip
    """Where the gate and up rows `offs_n` of one width-I expert live: routed expert `index`
    (rows of w13 seen as [E * 2I, H]) or shared slice `index` (rows of the shared MLP's
    [gate (SI) | up (SI)]). -> (weight base, gate rows, up rows, scale base, gate and up scale
    offsets: add the K block). Shared by this file's and `moe_grouped`'s gate_up kernels."""
    if routed:
        base = w_ptr
        gate_rows = index * (2 * INTER) + offs_n
        up_rows = gate_rows + INTER
        sbase = s_ptr
        sg = index * s_e_stride + (offs_n // ROW_DIV) * s_r_stride
        su = index * s_e_stride + ((offs_n + INTER) // ROW_DIV) * s_r_stride
    else:
        base = sw_ptr
        gate_rows = index * INTER + offs_n
        up_rows = gate_rows + S * INTER
        sbase = ss_ptr
        sg = (gate_rows // SHARED_ROW_DIV) * ss_r_stride
        su = (up_rows // SHARED_ROW_DIV) * ss_r_stride
    return base, gate_rows, up_rows, sbase, sg, su


@triton.jit
def expert_down_cols(
    routed, index, offs_n, w_ptr, s_ptr, sw_ptr, ss_ptr, s_e_stride, s_r_stride, ss_r_stride,
    H: tl.constexpr, INTER: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """Where the down projection's output rows `offs_n` of one width-I expert live: w2[index]
    [H, I] for a routed expert, columns [s*I, (s+1)*I) of the shared MLP's [H, S*I] for shared
    slice s = `index`. -> (base, row stride, first column, scale pointers of the rows: add the
    K block); element (n, k) is at base + n * row stride + first column + k. Shared by this
    file's and `moe_grouped`'s down kernels."""
    row_stride = tl.where(routed, INTER, S * INTER)
    col0 = tl.where(routed, 0, index * INTER)
    if routed:
        base = w_ptr + index * H * INTER
        srow = s_ptr + index * s_e_stride + (offs_n // 128) * s_r_stride
    else:
        base = sw_ptr
        srow = ss_ptr + (offs_n // 128) * ss_r_stride + col0 // 128
    return base, row_stride, col0, srow


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, h_ptr,
    s_e_stride, s_r_stride, ss_r_stride,
    H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, S: tl.constexpr,
    ROW_DIV: tl.constexpr, SHARED_ROW_DIV: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(PDL)
    t = pair // (K + S)
    slot = pair % (K + S)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    routed = slot < K
    index = tl.where(routed, tl.load(ids_ptr + t * K + tl.minimum(slot, K - 1)), slot - K)
    base, gate_rows, up_rows, sbase, sg, su = expert_gate_up_rows(
        routed, index, offs_n, w_ptr, s_ptr, sw_ptr, ss_ptr, s_e_stride, s_r_stride, ss_r_stride,
        INTER, S, ROW_DIV, SHARED_ROW_DIV,
    )  # fmt: skip
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_row = x_ptr + t * H
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < H
        xk = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        m = mask_n[:, None] & mask_k[None, :]
        wg = tl.load(base + gate_rows[:, None] * H + offs_k[None, :], mask=m, other=0.0)
        wu = tl.load(base + up_rows[:, None] * H + offs_k[None, :], mask=m, other=0.0)
        pg = tl.sum(wg.to(tl.float32) * xk[None, :], axis=1)
        pu = tl.sum(wu.to(tl.float32) * xk[None, :], axis=1)
        if HAS_SCALE:  # BLOCK_K divides 128: one scale column per step
            kb = k0 // 128
            pg *= tl.load(sbase + sg + kb, mask=mask_n, other=0.0)
            pu *= tl.load(sbase + su + kb, mask=mask_n, other=0.0)
        acc_g += pg
        acc_u += pu
    dtype = h_ptr.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    out = act * acc_u.to(dtype).to(tl.float32)
    tl.store(h_ptr + pair * INTER + offs_n, out.to(dtype), mask=mask_n)


@triton.jit
def _down_kernel(
    h_ptr, ids_ptr, wts_ptr, w_ptr, s_ptr, sw_ptr, ss_ptr, part_ptr,
    s_e_stride, s_r_stride, ss_r_stride,
    H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, S: tl.constexpr,
    HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(PDL)
    t = pair // (K + S)
    slot = pair % (K + S)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    routed = slot < K
    weight = tl.where(routed, tl.load(wts_ptr + t * K + tl.minimum(slot, K - 1)), 1.0)
    index = tl.where(routed, tl.load(ids_ptr + t * K + tl.minimum(slot, K - 1)), slot - K)
    base, row_stride, col0, srow = expert_down_cols(
        routed, index, offs_n, w_ptr, s_ptr, sw_ptr, ss_ptr, s_e_stride, s_r_stride, ss_r_stride,
        H, INTER, S,
    )  # fmt: skip
    rows = base + offs_n[:, None].to(tl.int64) * row_stride + col0
    h_row = h_ptr + pair * INTER
    part = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < INTER
        hk = tl.load(h_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        p = tl.sum(w.to(tl.float32) * hk[None, :], axis=1)
        if HAS_SCALE:
            p *= tl.load(srow + k0 // 128, mask=mask_n, other=0.0)
        part += p
    dtype = h_ptr.dtype.element_ty
    part = tl.where(routed, part.to(dtype).to(tl.float32), part)  # the unfused expert output
    tl.store(part_ptr + pair * H + offs_n, weight * part, mask=mask_n)


@triton.jit
def _combine_kernel(
    part_ptr, y_ptr, H: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(PDL)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(SLOTS):  # a fixed order: the same bits on every run
        acc += tl.load(part_ptr + (t * SLOTS + slot) * H + offs, mask=mask, other=0.0)
    tl.store(y_ptr + t * H + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


class MoeDecodeWeights:
    """One MoE layer's weights as the kernels read them, checked once (at the first forward,
    after loading): the routed stack, the shared MLP's (or none), FP8 scales where quantised.

    Raises ValueError naming what does not fit."""

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        shared_w13: torch.Tensor | None = None,
        shared_w2: torch.Tensor | None = None,
        *,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        shared_w13_scale: torch.Tensor | None = None,
        shared_w2_scale: torch.Tensor | None = None,
    ) -> None:
        num_experts, two_i, hidden = w13.shape
        inter = two_i // 2
        if tuple(w2.shape) != (num_experts, hidden, inter):
            raise ValueError(f"moe_decode: w2 {list(w2.shape)} vs w13 {list(w13.shape)}")
        self.hidden, self.inter = hidden, inter
        self.num_shared = 0
        if shared_w13 is not None:
            assert shared_w2 is not None  # internal: both or neither
            width = shared_w13.shape[0] // 2
            if width % inter or tuple(shared_w2.shape) != (hidden, width):
                raise ValueError(
                    f"moe_decode: shared MLP {list(shared_w13.shape)} / {list(shared_w2.shape)} "
                    f"is not S slices of the experts' width {inter}"
                )
            if shared_w13.dtype != w13.dtype:
                raise ValueError("moe_decode: shared and routed weights differ in dtype")
            self.num_shared = width // inter
        self.quantized = w13_scale is not None
        if self.quantized:
            assert w2_scale is not None  # internal: scales come together
            if self.num_shared and (shared_w13_scale is None or shared_w2_scale is None):
                raise ValueError("moe_decode: FP8 experts with unquantised shared experts")
            if self.num_shared and inter % _SCALE_BLOCK:
                raise ValueError(f"moe_decode: FP8 shared slices need I % 128 == 0, I = {inter}")
        for t in (
            w13,
            w2,
            shared_w13,
            shared_w2,
            w13_scale,
            w2_scale,
            shared_w13_scale,
            shared_w2_scale,
        ):
            if t is not None and not t.is_contiguous():
                raise ValueError("moe_decode: weights and scales must be contiguous")
        self.w13, self.w2 = w13, w2
        # Absent tensors are passed as a harmless stand-in of the right pointer type; the
        # kernels never read them (S = 0 or HAS_SCALE off).
        self.shared_w13 = shared_w13 if shared_w13 is not None else w13
        self.shared_w2 = shared_w2 if shared_w2 is not None else w2
        self.w13_scale = w13_scale
        self.w2_scale = w2_scale
        self.shared_w13_scale = shared_w13_scale
        self.shared_w2_scale = shared_w2_scale
        self.row_div = self._row_div(w13_scale, two_i)
        self.shared_row_div = self._row_div(shared_w13_scale, 2 * inter * self.num_shared)
        for scale in (w2_scale, shared_w2_scale):
            if scale is not None and scale.shape[-2] != triton.cdiv(hidden, _SCALE_BLOCK):
                raise ValueError("moe_decode: down-projection scales must be 128-row blocks")

    @staticmethod
    def _row_div(scale: torch.Tensor | None, rows: int) -> int:
        """Output rows per scale row: 1 (per-row scales) or 128 (block scales)."""
        if scale is None or rows == 0 or scale.shape[-2] == rows:
            return 1
        if scale.shape[-2] == triton.cdiv(rows, _SCALE_BLOCK):
            return _SCALE_BLOCK
        raise ValueError(f"moe_decode: {scale.shape[-2]} scale rows for {rows} weight rows")


def scale_args(scale: torch.Tensor | None, stand_in: torch.Tensor) -> tuple:
    """(pointer, expert stride, row stride); strides are 0 where there is no such dim."""
    if scale is None:
        return stand_in, 0, 0
    if scale.dim() == 3:
        return scale, scale.stride(0), scale.stride(1)
    return scale, 0, scale.stride(0)


def moe_decode(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: MoeDecodeWeights,
    *,
    block_n: tuple[int, int] = (16, 16),
    block_k: tuple[int, int] = (128, 128),
    num_warps: int | None = None,
    combine: bool = True,
) -> torch.Tensor | MoePartials:
    """x [T, H], topk_weights [T, K] fp32, topk_ids [T, K] int64 -> y [T, H] (x's dtype).
    `block_n` / `block_k`: tiles of (gate_up, down); block_k must divide 128 with FP8 weights.
    Defaults from `bench/moe_decode.py --sweep` on an H100 (V2-Lite layer, bf16 and FP8): 16-row
    tiles, 8 warps for one token (7-10% faster there), 4 beyond. `combine=False` returns the
    per-slot partials uncombined (`MoePartials`), for the next norm to sum."""
    num_tokens, top_k = topk_ids.shape
    hidden, inter, shared = weights.hidden, weights.inter, weights.num_shared
    if x.shape != (num_tokens, hidden) or not x.is_contiguous():
        raise ValueError(f"moe_decode: x {list(x.shape)} vs {num_tokens} tokens x {hidden}")
    y = torch.empty_like(x)
    if num_tokens == 0:
        return y
    pairs = num_tokens * (top_k + shared)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    wts = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    has_scale = weights.quantized
    pdl = pdl_args(x.device)
    if num_warps is None:
        num_warps = 8 if num_tokens == 1 else 4
    # a missing shared scale's stand-in must be a pointer of the routed scale's type
    s13, s13_e, s13_r = scale_args(weights.w13_scale, weights.w13)
    ss13, _, ss13_r = scale_args(weights.shared_w13_scale, s13)
    _gate_up_kernel[(pairs, triton.cdiv(inter, block_n[0]))](
        x, ids, weights.w13, s13, weights.shared_w13, ss13, h,
        s13_e, s13_r, ss13_r,
        H=hidden, INTER=inter, K=top_k, S=shared,
        ROW_DIV=weights.row_div, SHARED_ROW_DIV=weights.shared_row_div, HAS_SCALE=has_scale,
        BLOCK_N=block_n[0], BLOCK_K=block_k[0], num_warps=num_warps, **pdl,
    )  # fmt: skip
    s2, s2_e, s2_r = scale_args(weights.w2_scale, weights.w2)
    ss2, _, ss2_r = scale_args(weights.shared_w2_scale, s2)
    part = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(pairs, triton.cdiv(hidden, block_n[1]))](
        h, ids, wts, weights.w2, s2, weights.shared_w2, ss2, part,
        s2_e, s2_r, ss2_r,
        H=hidden, INTER=inter, K=top_k, S=shared, HAS_SCALE=has_scale,
        BLOCK_N=block_n[1], BLOCK_K=block_k[1], num_warps=num_warps, **pdl,
    )  # fmt: skip
    if not combine:
        return MoePartials(part.view(num_tokens, top_k + shared, hidden), x.dtype)
    combine_partials(part, y, top_k + shared)
    return y


def combine_partials(part: torch.Tensor, y: torch.Tensor, slots: int) -> None:
    """part [T * slots, H] fp32 -> y [T, H]: each token's partials summed in slot order."""
    hidden = y.shape[1]
    block = min(triton.next_power_of_2(hidden), 1024)
    _combine_kernel[(y.shape[0], triton.cdiv(hidden, block))](
        part,
        y,
        H=hidden,
        SLOTS=slots,
        BLOCK=block,
        num_warps=4,
        **pdl_args(y.device),
    )
