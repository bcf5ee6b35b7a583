"""MLA's absorbed per-head projections at decode sizes, one launch: y[t, h] = x[t, h] @ W_h.

    x   [T, H, K]  model dtype, last dim contiguous, any token / head strides (split views of
                   the q projection, the attention output)
    w   [H, ...]   per head, model dtype, as `MLAAttention` keeps them (views of kv_b_proj):
                   W_UK [H, d_n, r]: x = q_nope (K = d_n) -> y = the latent query (N = r)
                   W_UV [H, r, d_v] (a transposed view): x = the latent output (K = r) -> y = v
                   i.e. w[h] is [K, N] with any strides (one of them 1)
    y   [T, H, N]  new, contiguous, x's dtype

Why: at decode the two are batched GEMMs of one row per head (torch.bmm: a cuBLAS GEMM padded to
a tensor-core tile, 3.2-3.4 us each per V2-Lite layer at bs 1 on an H100, for 1 MB of weights).
Here one program owns BLOCK_N outputs of one head and walks K (128 or 512) once, reading its
weight tile once for every token row; fp32 accumulation, one rounding (bmm's). The weight is
read in place through its strides (no transposed copy: for V3 that would be 1 GB).

Grid (H, cdiv(N, BLOCK_N)). Launches read no device value on the host: CUDA-graph safe. T is a
runtime value (not specialised): one compile per layer shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["HEAD_GEMV_MAX_T", "head_gemv"]

HEAD_GEMV_MAX_T = 8  # rows per head the kernel is built for (its token loop is unrolled)


@triton.jit(do_not_specialize=["T"])
def _head_gemv_kernel(
    x_ptr, w_ptr, y_ptr, T,
    x_st, x_sh, w_sh, w_sk, w_sn,
    H: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
    MAX_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_head = w_ptr + h * w_sh
    for t in tl.static_range(MAX_T):
        if t < T:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            x_row = x_ptr + t * x_st + h * x_sh
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                mask_k = k < K
                xk = tl.load(x_row + k, mask=mask_k, other=0.0).to(tl.float32)
                w = tl.load(
                    w_head + k[:, None] * w_sk + offs_n[None, :] * w_sn,
                    mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0,
                )  # [BLOCK_K, BLOCK_N]; L1/L2 hits from the second token on
                acc += tl.sum(w.to(tl.float32) * xk[:, None], axis=0)
            y_row = y_ptr + (t * H + h) * N
            tl.store(y_row + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def head_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] (last dim contiguous), w [H, K, N] (any strides) -> y [T, H, N] contiguous in
    x's dtype. Raises ValueError on shapes, dtypes or strides that do not fit, or T > 8."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise ValueError(
            f"head_gemv: x [T, H, K] and w [H, K, N] do not match: {list(x.shape)}, {list(w.shape)}"
        )
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"head_gemv: x and w need one float dtype, got {x.dtype}, {w.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("head_gemv: x needs a contiguous last dim")
    if x.device != w.device:
        raise ValueError(f"head_gemv: x on {x.device}, w on {w.device}")
    t, h, k = x.shape
    n = w.shape[2]
    if t > HEAD_GEMV_MAX_T:
        raise ValueError(f"head_gemv: {t} tokens > HEAD_GEMV_MAX_T = {HEAD_GEMV_MAX_T}")
    y = torch.empty((t, h, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    block_n = min(64, triton.next_power_of_2(n))
    _head_gemv_kernel[(h, triton.cdiv(n, block_n))](
        x, w, y, t,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        H=h, K=k, N=n, MAX_T=HEAD_GEMV_MAX_T, BLOCK_N=block_n,
        BLOCK_K=min(128, triton.next_power_of_2(k)), num_warps=4,
    )  # fmt: skip
    return y
