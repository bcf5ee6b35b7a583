"""A decode-sized linear: y = x @ W^T for a few tokens in one launch that streams W once.

    x        [M, K]  bf16 / fp16 / fp32, contiguous, 1 <= M <= GEMV_MAX_M (M = 0: empty y)
    w        [N, K]  x's dtype, fp32 (the MoE router's fp32 gate), or float8_e4m3fn; contiguous
    w_scale  [ceil(N/128), ceil(K/128)] fp32 (DeepSeek-V3 `weight_scale_inv`: one per 128 x 128
             block), or [N, ceil(K/128)] (per-row, for merged weights whose shards are not
             128-row aligned; `fp8_quant.expand_scale_rows`); contiguous; FP8 weights only
    returns  [M, N]  `out_dtype` (default x's):
             W[n, k] = w[n, k] * w_scale[n // 128 (or n), k // 128]

FP8 weights are widened to fp32 in registers (W8A16): the activations are never quantised.

Why: at M <= 8 every linear of a decode step is bound by reading its weight once, and launches
cost as much as bytes. `block_fp8_linear` at M = 1 takes four (activation quantisation, a split-K
W8A8 GEMM, the split reduction, the cast); its one-launch W8A16 GEMM (M >= 2) pads M to a
16-row tensor-core tile and has too few loads in flight at decode N (fp8_gemm.py). Here each
program owns BLOCK_N rows of W and walks K once; each weight tile is loaded once and multiplied
against every token row with plain FMAs (at M <= 16 a tensor-core tile would be mostly padding).
fp32 accumulation, the FP8 scale applied per (row, 128-wide K block) partial sum, one rounding.

No split over K across programs: summing the partials deterministically in the same launch would
need inter-program synchronisation (atomics). Small N instead gets small BLOCK_N (down to one
row per program) and wide BLOCK_K, so the grid still covers every SM (`gemv_config`).

Launches read no device value on the host and allocate y by shape only: CUDA-graph safe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.ops.fp8_quant import dequantize_weight_block
from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel
from mlaserve.ops.triton_support import num_sms

__all__ = [
    "GEMV_MAX_M",
    "GemvConfig",
    "gemv",
    "gemv_config",
    "gemv_reference",
    "gemv_warm_up_tasks",
]

# Past this M the per-thread accumulators (M per weight vector) crowd the registers; callers
# switch to the tensor-core GEMMs (F.linear, fp8_gemm.py) well before.
GEMV_MAX_M = 16
_SCALE_BLOCK = 128  # FP8 block edge along N and K
FP8_LONG_K = 4096  # FP8 at one token from this K on: `gemv_config`'s long-K tile
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8 = torch.float8_e4m3fn


class GemvConfig(NamedTuple):
    """block_n: rows of W per program (a power of two <= 128, so a program's rows never
    straddle a 128-row scale block); block_k: K elements per loop step (a power of two >= 16);
    num_warps: per program."""

    block_n: int
    block_k: int
    num_warps: int


# M is a runtime value (not specialised), so one compile serves every M of a power-of-two
# bucket (BLOCK_M): `gemv_warm_up_tasks` compile the buckets a layer uses before serving.
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, s_stride, M,
    N: tl.constexpr, K: tl.constexpr,
    HAS_SCALE: tl.constexpr, ROW_DIV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr, VEC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # A K step is a [T, R, BLOCK_N, VEC] tile: R sub-steps of SUB_K (<= 128 with FP8: one scale
    # column each), T vectors of VEC contiguous elements per row of a sub-step. The sum over VEC
    # is in-thread; the T (and R) partials stay apart in `acc` until the end, so the loop has no
    # cross-thread reduction. T first: Triton (3.6, sm_90 TTGIR checked) then gives consecutive
    # threads consecutive vectors of one row, coalesced. VEC is 16 bytes of x, not of w: x's
    # and w's loads then get the same register layout (see x_rows).
    R: tl.constexpr = BLOCK_K // SUB_K
    T: tl.constexpr = SUB_K // VEC
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    step = (
        tl.arange(0, T)[:, None, None, None] * VEC
        + offs_r[None, :, None, None] * SUB_K
        + tl.arange(0, VEC)[None, None, None, :]
    )  # [T, R, 1, VEC]
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[None, None, :, None] * K
    # x is loaded through a pointer tensor of the weight tile's shape (every row the same
    # address): it then gets the tile's register layout. A [T, R, 1, VEC] load would get its
    # own and be converted through shared memory, with a barrier, every step and row.
    x_rows = x_ptr + tl.zeros([1, 1, BLOCK_N, 1], dtype=tl.int32)
    s_rows = s_ptr + (offs_n // ROW_DIV)[None, :] * s_stride  # [1, BLOCK_N]
    mask_w = mask_n[None, None, :, None]
    # Weights are constants, so the first step's tile (and its scales) is loaded before the
    # wait: under PDL its DRAM latency overlaps the previous kernel's tail instead of following
    # it. Each later tile is loaded one step ahead (a register double buffer), so a program
    # always has a tile in flight while it multiplies the current one.
    w_next = tl.load(w_rows + step, mask=mask_w & (step < K), other=0.0)
    if HAS_SCALE:
        mask_s = mask_n[None, :] & (offs_r < (K + 127) // 128)[:, None]
        s_next = tl.load(s_rows + offs_r[:, None], mask=mask_s, other=0.0)  # [R, BLOCK_N]
    acc = tl.zeros([T, R, BLOCK_N, BLOCK_M], dtype=tl.float32)
    wait_for_previous_kernel(PDL)  # x is the previous kernel's output
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + step
        mask_k = offs_k < K
        w = w_next.to(tl.float32)
        w_next = tl.load(w_rows + offs_k + BLOCK_K, mask=mask_w & (offs_k + BLOCK_K < K), other=0.0)
        if HAS_SCALE:
            scale = s_next[None]  # [1, R, BLOCK_N]; R = 1 when BLOCK_K <= 128
            col = (k0 + BLOCK_K) // 128 + offs_r
            mask_s = mask_n[None, :] & (col < (K + 127) // 128)[:, None]
            s_next = tl.load(s_rows + col[:, None], mask=mask_s, other=0.0)
        for m in tl.static_range(BLOCK_M):  # the weight tile is read once for all rows
            # rows past M (padding to the bucket) load zeros and are not stored
            xm = tl.load(x_rows + m * K + offs_k, mask=mask_k & (m < M), other=0.0)
            xm = xm.to(tl.float32)
            part = tl.sum(w * xm, axis=3)  # [T, R, BLOCK_N]
            if HAS_SCALE:
                part *= scale
            # m is static: the select folds away, each row adds to its own registers
            acc = tl.where(offs_m[None, None, None, :] == m, acc + part[:, :, :, None], acc)
    out = tl.sum(tl.sum(acc, axis=1), axis=0)  # [BLOCK_N, BLOCK_M]
    y = y_ptr + offs_m[None, :] * N + offs_n[:, None]
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=(offs_m[None, :] < M) & mask_n[:, None])


def gemv_config(m: int, n: int, k: int, fp8: bool, num_sms: int = 132) -> GemvConfig:
    """Tiles by shape (no autotuning: a tuning run inside graph capture would break it), for
    16-bit activations, from `bench/gemv.py --sweep-configs` (timings: bench/RESULTS.md).

    bf16 at M <= 2, and FP8 at M = 1 with K <= 2048 and W of <= 8M elements (decode at batch
    1-2, where small weights are latency-bound): rows of W read in long runs, few rows per
    program, many programs. block_k is the whole K up to 1024 elements (bf16) or 2048 (FP8), at
    most 8192 elements a tile (two tiles are in flight in registers); block_n the largest power
    of two <= 16 that still gives >= 6 programs per SM; 4 warps where a tile has >= 4096
    elements, else 8. This beat the rule below on V2-Lite's and V3's bf16 weights; FP8 at M = 2
    and V3's FP8 weights lost this way and keep the rule below.

    FP8 at M = 1 with K >= FP8_LONG_K (V3's q_a | kv_a, K = 7168; its o_proj under TP2, K =
    8192): two rows per program, the whole K (up to 8192) a step, 4 warps: 1.3-1.8x faster than
    the rule below on those shapes, which left too few bytes in flight per program.

    Otherwise:
    - block_n: the largest power of two <= 16 that still gives >= 3 programs per SM. Rows per
      program are the only parallelism (no K split), and at ~1.5 programs per SM the SMs
      holding two finish last; at >= 3 the imbalance is a third at worst. N = 576 gets one row
      per program (576 programs), V3's q_b (N = 24576) 16 rows, as moe_decode's measured tile.
    - num_warps: 8 at M <= 2 (faster than 4 at one token in moe_decode's GEMV sweep), 4
      beyond, where each thread's share of the M accumulators grows.
    - block_k: 16 bytes of weight per thread per step (one 8-element vector of bf16, two of
      FP8: x's vectors are 8 elements), one vector at M > 8 where the per-thread accumulators
      (vectors x M) would crowd the registers. Capped at K's next power of two."""
    if fp8 and m == 1 and k >= FP8_LONG_K:
        return GemvConfig(2, min(8192, triton.next_power_of_2(k)), 4)
    if (m <= 2 and not fp8) or (m == 1 and k <= 2048 and n * k <= 1 << 23):
        block_k = min(2048 if fp8 else 1024, triton.next_power_of_2(k))
        block_n = 16
        while block_n > 1 and triton.cdiv(n, block_n) < 6 * num_sms:
            block_n //= 2
        block_k = max(16, min(block_k, 8192 // block_n))  # <= 8192 elements per tile
        return GemvConfig(block_n, block_k, 4 if block_n * block_k >= 4096 else 8)
    warps = 8 if m <= 2 else 4
    block_n = 16
    while block_n > 1 and triton.cdiv(n, block_n) < 3 * num_sms:
        block_n //= 2
    vectors = 2 if fp8 and m <= 8 else 1
    block_k = vectors * 8 * 32 * warps // block_n
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    return GemvConfig(block_n, block_k, warps)


def _check(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> int:
    """Raises ValueError naming what does not fit; returns the scale's rows per scale row."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"gemv: x {list(x.shape)} and w {list(w.shape)} must be 2-D")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"gemv: x is {x.dtype}, expected bf16, fp16 or fp32")
    if w.dtype not in (x.dtype, _FP8, torch.float32):
        raise ValueError(f"gemv: w is {w.dtype}, expected x's dtype ({x.dtype}), float32 or {_FP8}")
    (m, k), n = x.shape, w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"gemv: x {list(x.shape)} and w {list(w.shape)} differ in K")
    if m > GEMV_MAX_M:
        raise ValueError(f"gemv: M = {m} tokens > GEMV_MAX_M = {GEMV_MAX_M}; use a GEMM")
    if not x.is_contiguous() or not w.is_contiguous():
        raise ValueError("gemv: x and w must be contiguous")
    if x.device != w.device:
        raise ValueError(f"gemv: x on {x.device}, w on {w.device}")
    if w.dtype != _FP8:
        if w_scale is not None:
            raise ValueError(f"gemv: w_scale given for {w.dtype} weights (FP8 only)")
        return 1
    if w_scale is None:
        raise ValueError("gemv: FP8 weights need w_scale")
    kb, nb = triton.cdiv(k, _SCALE_BLOCK), triton.cdiv(n, _SCALE_BLOCK)
    if w_scale.dtype != torch.float32 or w_scale.device != w.device:
        raise ValueError(f"gemv: w_scale must be fp32 on {w.device}, is {w_scale.dtype}")
    if w_scale.dim() != 2 or w_scale.shape[1] != kb or w_scale.shape[0] not in (n, nb):
        raise ValueError(
            f"gemv: w_scale {list(w_scale.shape)} for w {list(w.shape)}: expected "
            f"[{nb} (128-row blocks) or {n} (per row), {kb}]"
        )
    if not w_scale.is_contiguous():
        raise ValueError("gemv: w_scale must be contiguous")
    return 1 if w_scale.shape[0] == n else _SCALE_BLOCK  # N = 1: both forms are one row


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x [M, K], w [N, K] (x's dtype, fp32 or e4m3), w_scale (FP8 only) -> y = x @ W^T [M, N]
    in `out_dtype` (default x's). `config` overrides `gemv_config` (bench sweeps, tests).
    Raises ValueError on inputs that do not fit (see the module docstring)."""
    row_div = _check(x, w, w_scale)
    (m, k), n = x.shape, w.shape[0]
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"gemv: out_dtype {out_dtype} is not bf16, fp16 or fp32")
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if config is None:
        config = gemv_config(triton.next_power_of_2(m), n, k, w.dtype == _FP8, num_sms(x.device))
    block_n, block_k, warps = config
    for name, v, lo, hi in (("block_n", block_n, 1, 128), ("block_k", block_k, 16, 1 << 16)):
        if not lo <= v <= hi or v & (v - 1):
            raise ValueError(f"gemv: {name} = {v} must be a power of two in [{lo}, {hi}]")
    has_scale = w_scale is not None
    pdl = pdl_args(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, w_scale if has_scale else x, y, w_scale.stride(0) if has_scale else 0, m,
        N=n, K=k, HAS_SCALE=has_scale, ROW_DIV=row_div,
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        SUB_K=min(block_k, _SCALE_BLOCK) if has_scale else block_k,
        VEC=16 // x.element_size(), num_warps=warps, **pdl,
    )  # fmt: skip
    return y


def gemv_warm_up_tasks(
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    max_m: int,
    x_dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
) -> list[Callable[[], None]]:
    """One task per M bucket a layer with weight `w` takes up to `max_m` tokens: each runs the
    GEMV once on zeros, so that bucket's variant compiles before serving (a Triton compile is a
    stall of ~0.5 s). Tasks are independent (`model/kernel_warm_up.py` runs them on threads)."""
    tasks: list[Callable[[], None]] = []
    bucket = 1
    while max_m > 0 and bucket <= triton.next_power_of_2(min(max_m, GEMV_MAX_M)):
        tasks.append(
            functools.partial(_gemv_once, min(bucket, max_m), w, w_scale, x_dtype, out_dtype)
        )
        bucket *= 2
    return tasks


def _gemv_once(
    m: int,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    x_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
) -> None:
    x = torch.zeros(m, w.shape[1], dtype=x_dtype, device=w.device)
    gemv(x, w, w_scale, out_dtype=out_dtype)


def gemv_reference(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 product the kernel approximates: x @ W^T with W dequantised (block or per-row
    scales: `dequantize_weight_block` infers the block edge from the scale's row count)."""
    weight = w.float() if w_scale is None else dequantize_weight_block(w, w_scale)
    return x.float() @ weight.t()
