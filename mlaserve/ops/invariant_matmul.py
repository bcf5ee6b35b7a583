"""A batch-invariant matmul: every output row's bits depend on its own input row alone.

    invariant_matmul(x, w, scale, bias, out_dtype, leaves)   y = x @ W.T (+ b)
        x      [M, K]     bf16 / fp16 / fp32, last dim contiguous (row stride free)
        w      [N, K]     any strides; the model dtype, fp32 (the router), or float8_e4m3fn with
                          fp32 `scale` [ceil(N/128) or N, ceil(K/128)] (`fp8_linear.py` layout)
        bias   [N] or None, added in fp32 before the one rounding
        leaves 1 (default), or 2 / 4 / 8: K in that many equal chunks (each a multiple of 128
               with FP8 weights), each chunk's fp32 sum a leaf of the deterministic mode's
               summation tree, the leaves summed in registers in its order
               (`invariant_rowwise.tree_sum`): a tensor-parallel rank's subtree of a
               row-parallel product (no bias then)
        y      [M, N]     `out_dtype` (default x's), contiguous
    invariant_head_matmul(x, w)   per head h: y[:, h] = x[:, h] @ w[h].T
        x [M, H, K] (last dim contiguous), w [H, N, K] any strides -> y [M, H, N] x's dtype
        (MLA's absorbed W_UK / W_UV products, batched over heads in one launch)

Why: cuBLAS (and Triton autotuning) pick a GEMM by M, and a split-K, a different tile or a GEMV
sums a row's K products in another order, so a token's bits change with the batch it shares
(issue 40). Here the tile (`TILES`), the warps and the stages are fixed constants, M is not
specialised (`do_not_specialize`), there is no split over K, and each program accumulates its
[BLOCK_M, BLOCK_N] tile in fp32 over K in ascending BLOCK_K steps. A row's result is then the
same function of its own data whatever M is, wherever the row sits in its tile, and whatever
the other rows (padding included) hold: rows of a tensor-core MMA never mix.

FP8 weights run W8A16: e4m3 widens exactly to the activations' dtype, each 128-wide K step's
product is scaled by its block scale in fp32 and added (BLOCK_K = 128, one scale column a step).
fp32 operands (the router's gate, fp32 models) use IEEE fp32 products, never TF32.

`ops/invariant_rowwise.py` holds the torch forms (the CPU path and the references).
Launches read no device value on the host: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.fp8_triton import widen_e4m3
from mlaserve.ops.invariant_rowwise import leaf_width, scale_row_div
from mlaserve.ops.invariant_tree import settled, tree_step
from mlaserve.ops.triton_support import interpreting

__all__ = [
    "TILES",
    "TILES_FP32",
    "invariant_head_matmul",
    "invariant_matmul",
]

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Fixed: the invariance rests on it. BLOCK_K
# is one FP8 scale block. fp32 operands take a narrower K step (registers / shared memory).
TILES = (64, 64, 128, 4, 3)
TILES_FP32 = (64, 64, 32, 4, 2)


@triton.jit
def _leaf(
    x_rows, w_cols, s_ptr, offs_k, offs_n, mask_m, mask_n, sw_k, s_stride, k_lo,
    KC: tl.constexpr, HAS_SCALE: tl.constexpr, ROW_DIV: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One tile's fp32 sum over K columns [k_lo, k_lo + KC), in ascending BLOCK_K steps."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + KC, BLOCK_K):  # ascending, no split: the one summation order
        kk = k0 + offs_k
        mask_k = kk < k_lo + KC
        x = tl.load(x_rows + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(
            w_cols + kk.to(tl.int64)[:, None] * sw_k,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        elif HAS_SCALE:  # e4m3 -> x's dtype is exact; the block's product scaled in fp32
            part = tl.dot(x, widen_e4m3(w, x.dtype))
            s = tl.load(s_ptr + (offs_n // ROW_DIV) * s_stride + k0 // BLOCK_K, mask=mask_n)
            acc += part * s[None, :]
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M,
    sx_m, sx_h, sw_n, sw_k, sw_h, sy_m, sy_h, s_stride,
    N: tl.constexpr, K: tl.constexpr, HAS_SCALE: tl.constexpr, ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LEAVES: tl.constexpr, BARRIER: tl.constexpr,
):  # fmt: skip
    # grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), heads): one output tile of one head
    head = tl.program_id(2).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = x_ptr + head * sx_h + offs_m.to(tl.int64)[:, None] * sx_m
    w_cols = w_ptr + head * sw_h + offs_n.to(tl.int64)[None, :] * sw_n
    acc = _leaf(
        x_rows, w_cols, s_ptr, offs_k, offs_n, mask_m, mask_n, sw_k, s_stride, 0, K // LEAVES,
        HAS_SCALE, ROW_DIV, FP32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    # the leaves' tree, in order, each leaf settled first (`ops/invariant_tree.py`)
    if LEAVES > 1:
        acc = settled(acc, BARRIER)
    p1 = acc
    p2 = acc
    p4 = acc
    for c in tl.static_range(1, LEAVES):
        node = _leaf(
            x_rows, w_cols, s_ptr, offs_k, offs_n, mask_m, mask_n, sw_k, s_stride,
            c * (K // LEAVES), K // LEAVES, HAS_SCALE, ROW_DIV, FP32, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        acc, p1, p2, p4 = tree_step(c, settled(node, BARRIER), p1, p2, p4)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + head * sy_h + offs_m.to(tl.int64)[:, None] * sy_m + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _launch(x, w, scale, bias, y, heads, strides, leaves=1) -> None:
    """strides: (sx_m, sx_h, sw_n, sw_k, sw_h, sy_m, sy_h) in elements."""
    m, k = x.shape[0], x.shape[-1]
    n = w.shape[-2]
    if m == 0 or n == 0:
        return
    fp32 = torch.float32 in (x.dtype, w.dtype) and scale is None
    block_m, block_n, block_k, warps, stages = TILES_FP32 if fp32 else TILES
    row_div = scale_row_div(w, scale) if scale is not None else 1
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), heads)
    _invariant_matmul_kernel[grid](
        x, w, scale if scale is not None else w, bias if bias is not None else w, y, m,
        *strides, scale.stride(0) if scale is not None else 0, N=n, K=k,
        HAS_SCALE=scale is not None, ROW_DIV=row_div, HAS_BIAS=bias is not None, FP32=fp32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, LEAVES=leaves,
        BARRIER=not interpreting(), num_warps=warps, num_stages=stages,
    )  # fmt: skip


def invariant_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    leaves: int = 1,
) -> torch.Tensor:
    """x [..., K] -> [..., N] = x @ W.T (+ bias), see the module docstring."""
    lead, k = x.shape[:-1], x.shape[-1]
    leaf_width(k, leaves, "invariant_matmul: K", fp8=scale is not None)
    if leaves > 1 and bias is not None:
        raise ValueError("invariant_matmul: a bias with leaves (add it after the tree's sum)")
    x2 = x.reshape(-1, k)
    if x2.shape[0] and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"invariant_matmul: x [..., {k}] vs weight {list(w.shape)}")
    if (w.dtype == torch.float8_e4m3fn) != (scale is not None):
        raise ValueError("invariant_matmul: an FP8 weight needs its scale, and only it")
    n = w.shape[0]
    y = torch.empty(x2.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    strides = (x2.stride(0), 0, w.stride(0), w.stride(1), 0, n, 0)
    _launch(x2, w, scale, bias, y, 1, strides, leaves)
    return y.view(*lead, n)


def invariant_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, H, K], w [H, N, K] -> y [M, H, N], y[:, h] = x[:, h] @ w[h].T."""
    m, h, k = x.shape
    if w.dim() != 3 or w.shape[0] != h or w.shape[2] != k:
        raise ValueError(f"invariant_head_matmul: x {list(x.shape)} vs weight {list(w.shape)}")
    if m and x.stride(-1) != 1:
        x = x.contiguous()
    n = w.shape[1]
    y = torch.empty(m, h, n, dtype=x.dtype, device=x.device)
    strides = (x.stride(0), x.stride(1), w.stride(1), w.stride(2), w.stride(0), h * n, n)
    _launch(x, w, None, None, y, h, strides)
    return y
