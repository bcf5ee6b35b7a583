"""The W8A16 block-FP8 GEMM at decode sizes: the weight (e4m3 + 128 x 128 block scales) widened
to the activations' dtype in registers, the activations never quantised.

    w8a16_block_fp8_matmul_triton(x [M, K] bf16/fp16/fp32, W_q [N, K] e4m3, S_w [N/bn, Kb] fp32)
        -> [M, N] in out_dtype (x's by default)

Up to W8A16_WIDE_MAX_M rows `_w8a16_wide_kernel` (one 16-row MMA tile, BLOCK_N weight rows a
program, 2-4 K blocks in flight a loop step), split over K where a weight's tiles leave SMs
idle (`w8a16_wide_split`): each split's program parks its fp32 partial in a workspace
[SPLIT, M, N] and the tile's last to arrive sums them in split order (deterministic; the
arrival counters: `ops/split_counters.py`). Past 16 rows `fp8_triton.w8a16_dense_matmul_triton`.
Launches read no device value on the host: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.fp8_triton import (
    GROUP_K,
    NUM_PROGRAMS_TARGET,
    rows_per_scale,
    w8a16_dense_matmul_triton,
    widen_e4m3,
)
from mlaserve.ops.split_counters import arrive_last, k_splits, release, split_counters
from mlaserve.ops.triton_support import num_sms

__all__ = ["W8A16_WIDE_MAX_M", "w8a16_block_fp8_matmul_triton", "w8a16_wide_split"]

# Up to this many rows the W8A16 GEMM takes `_w8a16_wide_kernel` (one 16-row MMA tile).
W8A16_WIDE_MAX_M = 16
_WIDE_BLOCK_N = 32
# The wide kernel's K split (`w8a16_wide_split`): a weight of few rows (V3's q|kv_a, 2112; a TP8
# rank's dense gate_up, 4608) gives under WIDE_SPLIT_BELOW programs an SM, each walking all of a
# long K. Split toward WIDE_SPLIT_PROGRAMS_PER_SM, at most WIDE_MAX_SPLIT ways, each split at
# least WIDE_MIN_SPLIT_K keys (V2-Lite's 2048-key layers split in two ran slower).
WIDE_SPLIT_BELOW = 1.5
WIDE_SPLIT_PROGRAMS_PER_SM = 4
WIDE_MAX_SPLIT = 4
WIDE_MIN_SPLIT_K = 1536


@triton.jit(do_not_specialize=["M"])  # as `_block_fp8_matmul_kernel`
def _w8a16_wide_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, group_n,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
    SPLIT: tl.constexpr, KB_PER: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_N rows of W against all M (<= BLOCK_M) rows of x, over KB_PER K blocks
    # (the whole K unsplit). A loop step takes SUB 128-column K blocks, each its own load, MMA
    # and scale, so a step puts SUB weight tiles in flight where `_block_fp8_matmul_kernel`
    # puts one: at decode M the loop is bound by load latency, not by the MMAs. The blocks are
    # summed in K order, as there. Split (grid axis 1 = split index), each program parks its
    # fp32 partial [M, BLOCK_N] in ws [SPLIT, M, N]; the tile's last to arrive sums them in
    # split order (`ops/split_counters.py`). No PDL: launched with it (waiting before the
    # first load) it measured the same in the step (bench/RESULTS.md, thirty-ninth session).
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    mask_m = offs_m < M
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // group_n) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 0 unsplit: a constant, so that loop compiles as before the split
    kb_start = tl.program_id(1) * KB_PER if SPLIT > 1 else 0
    kb_end = kb_start + KB_PER
    for j in range(0, KB_PER, SUB):  # constant bounds (a runtime start upsets the interpreter)
        for r in tl.static_range(SUB):
            kb = kb_start + j + r
            kk = kb * 128 + offs_k
            mk = kk < K  # also past the last block
            if SPLIT > 1:  # and past this split's blocks (a last step of fewer than SUB)
                mk = mk & (kb < kb_end)
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                        mask=mask_m[:, None] & mk[None, :], other=0.0)  # fmt: skip
            b = tl.load(w_rows + kk[:, None], mask=mask_n[None, :] & mk[:, None], other=0.0)
            b_s = tl.load(s_rows + kb * stride_sk, mask=mask_n & (kb < kb_end), other=0.0)
            acc += tl.dot(a, widen_e4m3(b, a.dtype)) * b_s[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT == 1:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        rows = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + tl.program_id(1) * M * N + rows, acc, mask=mask)
        tile = cnt_ptr + tl.program_id(0)
        if arrive_last(tile, SPLIT):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sp in tl.static_range(SPLIT):
                acc += tl.load(ws_ptr + sp * M * N + rows, mask=mask, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
            release(tile)


def w8a16_wide_split(n: int, k: int, num_sms: int) -> int:
    """K splits of the wide kernel for an [n, k] weight: 1 where its BLOCK_N-row tiles give
    WIDE_SPLIT_BELOW programs an SM or more, else as many as bring the grid toward
    WIDE_SPLIT_PROGRAMS_PER_SM, at most WIDE_MAX_SPLIT, with splits of at least WIDE_MIN_SPLIT_K
    keys, lowered until it divides K's 128-wide blocks (every split the same whole blocks; a K
    off that grid never splits). A function of the weight and the GPU, not of M: a row's bits
    do not depend on the batch. H200, 2-16 rows (bench/RESULTS.md, thirty-ninth session): V3's
    q|kv_a 15.0 -> 10.2 us, a TP8 rank's dense gate_up 20.2 -> 16.4."""
    return k_splits(triton.cdiv(n, _WIDE_BLOCK_N), k, num_sms, split_below=WIDE_SPLIT_BELOW,
                    programs_per_sm=WIDE_SPLIT_PROGRAMS_PER_SM, max_split=WIDE_MAX_SPLIT,
                    min_split_k=WIDE_MIN_SPLIT_K)  # fmt: skip


def _w8a16_wide_sub(n: int, split: int = 1) -> int:
    """K blocks per loop step: 4 where the launch has under two programs per SM (bytes in
    flight must come from each program), 2 where it has more (fewer registers, more programs
    resident), and 2 split (its programs are the split grid's). `bench/RESULTS.md` (thirtieth
    session): V3's q|kv_a, o_proj and dense down take 4, q_b and the dense gate_up 2; the
    split q|kv_a 2 (thirty-ninth)."""
    if split > 1:
        return 2
    return 4 if triton.cdiv(n, _WIDE_BLOCK_N) < NUM_PROGRAMS_TARGET else 2


def _w8a16_wide(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    y: torch.Tensor,
    group_n: int,
    split: int | None,
) -> torch.Tensor:
    """`_w8a16_wide_kernel` into y [M, N], split `split` ways over K (None: by the rule)."""
    m, k = x.shape
    n = w_q.shape[0]
    if split is None:
        split = w8a16_wide_split(n, k, num_sms(x.device))
    blocks = triton.cdiv(k, GROUP_K)
    if split < 1 or blocks % split:
        raise ValueError(f"w8a16: split {split} does not divide K {k}'s {blocks} 128-wide blocks")
    tiles = triton.cdiv(n, _WIDE_BLOCK_N)
    if split > 1:  # fp32 partials, and the per-tile arrival counters
        ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        cnt = split_counters(x.device, tiles)
    else:
        ws = cnt = y  # unused
    _w8a16_wide_kernel[(tiles, split)](
        x, w_q, w_s, y, ws, cnt, m, n, group_n,
        x.stride(0), w_q.stride(0), w_s.stride(0), w_s.stride(1), y.stride(0),
        K=k, BLOCK_M=16, BLOCK_N=_WIDE_BLOCK_N, SUB=_w8a16_wide_sub(n, split),
        SPLIT=split, KB_PER=blocks // split, num_warps=4, num_stages=3,
    )  # fmt: skip
    return y


def w8a16_block_fp8_matmul_triton(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    split: int | None = None,
) -> torch.Tensor:
    """x [M, K] bf16/fp16/fp32, w_q [N, K] e4m3, w_s [N/bn, Kb] fp32 -> [M, N] (x's dtype by
    default): the weight widened to x's dtype in registers and block-rescaled per K step, so
    the activations are never quantised (exact where W8A8 rounds them to e4m3) and the op is
    one kernel launch. For decode-sized M, where the step is bound by bytes and launches.
    `split` forces the wide kernel's K split (tests, bench); None: `w8a16_wide_split`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    n = w_q.shape[0]
    gn = rows_per_scale(n, w_s.shape[0])
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    if m <= W8A16_WIDE_MAX_M:
        return _w8a16_wide(x, w_q, w_s, out, gn, split)
    return w8a16_dense_matmul_triton(x, w_q, w_s, out)
