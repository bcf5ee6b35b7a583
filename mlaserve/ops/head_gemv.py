"""MLA's absorbed per-head projections at decode sizes: y[t, h] = x[t, h] @ W[h], one launch.

    x    [T, H, K]  bf16 / fp16 / fp32; any strides with a contiguous last dim (q_nope is a
                    view into the q projection's output rows); 1 <= T <= HEAD_GEMV_MAX_M
    w    [H, K, N]  x's dtype; any strides with one unit stride, along K or along N:
                    W_UK is [H, d_n, r] with r contiguous, W_UV [H, r, d_v] with r contiguous
                    (both views of kv_b_proj's weight, no copies)
    out  [T, H, N]  x's dtype; any strides with a contiguous last dim (W_UV writes straight
                    into o_proj's [T, H * d_v] input rows); allocated when not given

fp32 accumulation over K, one rounding to x's dtype (cuBLAS's bmm accumulates in fp32 too, in
another order: the two agree to bf16 rounding, not bit for bit).

Why: these are the two batched GEMMs of an MLA decode step (q_nope -> latent, latent -> v). At a
few tokens each reads 2 MB of weights (V2-Lite; 16.8 MB on V3), which cuBLAS's bmm streams at
a fifth of the copy bandwidth (3.6 and 3.2 us per layer at bs 1, floor ~0.7 us, bench/
RESULTS.md), and as a library kernel it cannot launch early under PDL (`ops/pdl.py`). Here each
program owns BLOCK_N output columns of one head and walks K once, loading each weight tile once
for every token row (plain FMAs: at T <= 8 a tensor-core tile would be mostly padding).
Launches read no device value on the host: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["HEAD_GEMV_MAX_M", "head_gemv", "head_gemv_warm_up"]

# Token rows per launch: each is a static unroll step of the kernel; past it the bmm's tensor
# cores win.
HEAD_GEMV_MAX_M = 8
_TILE = 8192  # elements of a [BLOCK_K, BLOCK_N] weight tile: 64 fp32 per thread at 4 warps
_PROGRAMS = 256  # about two per SM of an H100


# M is a runtime value (not specialised): one compile per power-of-two bucket (BLOCK_M).
@triton.jit(do_not_specialize=["M"])
def _head_gemv_kernel(
    x_ptr, w_ptr, y_ptr, M,
    x_st, x_sh, w_sh, w_sk, w_sn, y_st, y_sh,
    K: tl.constexpr, N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    w_cols = w_ptr + h * w_sh + offs_n[None, :] * w_sn  # [1, BLOCK_N]
    x_row = x_ptr + h * x_sh
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The weights are constants: the first tile is loaded before the wait (under PDL its DRAM
    # latency overlaps the previous kernel; at V2-Lite's shapes it is the program's whole
    # share), each later one a step ahead (a register double buffer).
    offs_k = tl.arange(0, BLOCK_K)
    mask_w = (offs_k < K)[:, None] & mask_n[None, :]
    w_next = tl.load(w_cols + offs_k[:, None] * w_sk, mask=mask_w, other=0.0)
    wait_for_previous_kernel(PDL)  # x is the previous kernel's output
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = w_next.to(tl.float32)  # [BLOCK_K, BLOCK_N]
        nk = offs_k + BLOCK_K
        mask_w = (nk < K)[:, None] & mask_n[None, :]
        w_next = tl.load(w_cols + nk[:, None] * w_sk, mask=mask_w, other=0.0)
        for m in tl.static_range(BLOCK_M):  # the weight tile is read once for all rows
            xm = tl.load(x_row + m * x_st + offs_k, mask=mask_k & (m < M), other=0.0)
            part = tl.sum(w * xm.to(tl.float32)[:, None], axis=0)  # [BLOCK_N]
            # m is static: the select folds away, each row adds to its own registers
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    y = y_ptr + h * y_sh + offs_m[:, None] * y_st + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & mask_n[None, :])


def head_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, K], w [H, K, N] -> y [T, H, N] (into `out` when given; see the module
    docstring). Raises ValueError on inputs that do not fit."""
    if x.dim() != 3 or w.dim() != 3:
        raise ValueError(f"head_gemv: x {list(x.shape)} and w {list(w.shape)} must be 3-D")
    (m, heads, k), n = x.shape, w.shape[2]
    if w.shape[:2] != (heads, k):
        raise ValueError(f"head_gemv: w {list(w.shape)} does not fit x {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype != x.dtype:
        raise ValueError(f"head_gemv: x {x.dtype} and w {w.dtype} must be one float dtype")
    if not 1 <= m <= HEAD_GEMV_MAX_M:
        raise ValueError(f"head_gemv: {m} token rows, expected 1..{HEAD_GEMV_MAX_M}")
    if x.stride(2) != 1 or 1 not in w.stride()[1:]:
        raise ValueError("head_gemv: x needs a contiguous last dim, w a unit stride along K or N")
    if out is None:
        out = torch.empty(m, heads, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, heads, n) or out.dtype != x.dtype or out.stride(2) != 1:
        raise ValueError(f"head_gemv: out must be [{m}, {heads}, {n}] {x.dtype}, last dim unit")
    block_n = 16
    while block_n < 64 and triton.cdiv(n, block_n * 2) * heads >= _PROGRAMS:
        block_n *= 2
    block_k = min(triton.next_power_of_2(k), _TILE // block_n)
    pdl = pdl_args(x.device)
    _head_gemv_kernel[(triton.cdiv(n, block_n), heads)](
        x, w, out, m,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        K=k, N=n, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, **pdl,
    )  # fmt: skip
    return out


def head_gemv_warm_up(x_strides: tuple[int, int], heads: int, w: torch.Tensor, max_m: int) -> None:
    """Compile every M bucket up to `max_m` for x rows laid out with `x_strides` (token, head;
    Triton specialises on their divisibility) and weight `w` [H, K, N], so none compiles while
    serving."""
    k = w.shape[1]
    bucket = 1
    while bucket <= min(max_m, HEAD_GEMV_MAX_M):
        rows = torch.zeros(bucket * x_strides[0], dtype=w.dtype, device=w.device)
        head_gemv(rows.as_strided((bucket, heads, k), (*x_strides, 1)), w)
        bucket *= 2
