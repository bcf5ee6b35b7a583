"""Batch-invariant MLA attention over the paged latent cache: one query row, alone, per program.

    invariant_mla_attention(q_nope, q_pe, kv, k_scale, block_tables, row_seq, row_pos, scale)
        q_nope        [T, H, R]   absorbed query (q_nope @ W_UK), bf16 / fp16 / fp32, last dim
                                  contiguous (row and head strides free)
        q_pe          [T, H, DR]  roped, same dtype, last dim contiguous
        kv            [num_pages, PAGE, R + DR]  one layer's cache (`kv_cache/kv_pool.py`):
                                  rows [c_kv | k_pe], fp8_e4m3 (value = stored * k_scale) or the
                                  model dtype (k_scale 1)
        block_tables  [bs, P] int32; row_seq [T] int32: the sequence of each query row;
        row_pos       [T] int32: the row's own absolute position p (it sees keys 0..p)
        returns       [T, H, R] q_nope's dtype: softmax(q . k * scale) @ c_kv

Grid (T, cdiv(H, BLOCK_H)): each program attends one row's BLOCK_H heads over its keys
0..p in BLOCK_N tiles aligned to absolute position 0, in ascending order, with an fp32 online
softmax, and no split over the keys. The tiles, the order and every rounding are functions of
(p, the row's query, the cache bytes of keys 0..p) alone: a row's output is bitwise the same
whatever other rows the batch holds, how many, and whether the row is a prompt token (EXTEND),
a decode, a verify or a draft row. That is why this mode writes a step's own KV to the cache
first (the caller does): the row's keys then always come from the cache, in its dtype, read as
a decode step reads them.

Keys past p are masked out of the loads (other=0) and the scores (-inf), so stale or NaN pages
of the sequence's table are never read into a result. Cache values are widened to the query's
dtype (e4m3 -> bf16 is exact) and k_scale multiplies the scores and the output in fp32.

`ops/invariant_rowwise.py` holds its torch form (the CPU path and the reference).
Launches read no device value on the host: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.invariant_rowwise import check_attention_shapes
from mlaserve.ops.triton_support import interpreting

__all__ = ["BLOCK_H", "BLOCK_N", "invariant_mla_attention"]

# Fixed: the key tile (aligned to position 0) and the heads a program takes (tl.dot needs 16).
BLOCK_N = 32
BLOCK_H = 16
_NUM_WARPS = 4


@triton.jit
def _attend_tile(
    n0, pos, page_row, q_c, q_r, m_i, l_i, acc, kv_ptr, kv_page_stride, kv_row_stride, qk_scale,
    R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32: tl.constexpr,
):  # fmt: skip
    keys = n0 + tl.arange(0, BLOCK_N)
    kmask = keys <= pos
    page = tl.load(page_row + keys // PAGE, mask=kmask, other=0).to(tl.int64)
    rows = kv_ptr + page * kv_page_stride + (keys % PAGE).to(tl.int64) * kv_row_stride
    kc = tl.load(rows[:, None] + tl.arange(0, R)[None, :], mask=kmask[:, None], other=0.0)
    kr = tl.load(rows[:, None] + R + tl.arange(0, DR)[None, :], mask=kmask[:, None], other=0.0)
    kc = kc.to(q_c.dtype)
    kr = kr.to(q_c.dtype)
    if FP32:
        s = tl.dot(q_c, tl.trans(kc), input_precision="ieee")
        s = tl.dot(q_r, tl.trans(kr), s, input_precision="ieee")
    else:
        s = tl.dot(q_c, tl.trans(kc))
        s = tl.dot(q_r, tl.trans(kr), s)
    s = tl.where(kmask[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP32:
        acc = tl.dot(p, kc, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(kc.dtype), kc, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _invariant_mla_kernel(
    q_nope_ptr, q_pe_ptr, kv_ptr, bt_ptr, row_seq_ptr, row_pos_ptr, out_ptr,
    q_nope_t, q_nope_h, q_pe_t, q_pe_h, out_t, out_h, bt_stride, kv_page_stride, kv_row_stride,
    qk_scale, out_scale,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr, WHILE_LOOP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    seq = tl.load(row_seq_ptr + t).to(tl.int64)
    pos = tl.load(row_pos_ptr + t)
    q_c = tl.load(
        q_nope_ptr + t * q_nope_t + heads[:, None] * q_nope_h + tl.arange(0, R)[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    q_r = tl.load(
        q_pe_ptr + t * q_pe_t + heads[:, None] * q_pe_h + tl.arange(0, DR)[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    page_row = bt_ptr + seq * bt_stride
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, R], dtype=tl.float32)
    # Key 0 is always visible (p >= 0): after the first tile m_i is finite.
    if WHILE_LOOP:  # the interpreter: its scalars cannot bound a `range` (mla_decode._use_while)
        n0 = pos * 0
        while n0 <= pos:
            m_i, l_i, acc = _attend_tile(
                n0, pos, page_row, q_c, q_r, m_i, l_i, acc, kv_ptr, kv_page_stride,
                kv_row_stride, qk_scale, R, DR, PAGE, BLOCK_N, FP32,
            )  # fmt: skip
            n0 += BLOCK_N
    else:
        for n0 in range(0, pos + 1, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                n0, pos, page_row, q_c, q_r, m_i, l_i, acc, kv_ptr, kv_page_stride,
                kv_row_stride, qk_scale, R, DR, PAGE, BLOCK_N, FP32,
            )  # fmt: skip
    o = acc * (out_scale / l_i)[:, None]
    tl.store(
        out_ptr + t * out_t + heads[:, None] * out_h + tl.arange(0, R)[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None],
    )


def invariant_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    k_scale: float,
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Shapes, dtypes and layout in the module docstring."""
    num_tokens, heads, r, dr = check_attention_shapes(q_nope, q_pe, kv, row_seq, row_pos)
    out = torch.empty(num_tokens, heads, r, dtype=q_nope.dtype, device=q_nope.device)
    if num_tokens == 0:
        return out
    if q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("invariant_mla_attention: q_nope, q_pe and kv need a contiguous last dim")
    if r & (r - 1) or dr & (dr - 1):
        raise ValueError(f"invariant_mla_attention: R {r} and DR {dr} must be powers of two")
    fp8 = kv.dtype == torch.float8_e4m3fn
    grid = (num_tokens, triton.cdiv(heads, BLOCK_H))
    _invariant_mla_kernel[grid](
        q_nope, q_pe, kv, block_tables, row_seq, row_pos, out,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), kv.stride(0), kv.stride(1),
        float(softmax_scale) * (k_scale if fp8 else 1.0), k_scale if fp8 else 1.0,
        H=heads, R=r, DR=dr, PAGE=kv.shape[1], BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        FP32=q_nope.dtype == torch.float32,
        WHILE_LOOP=interpreting(), num_warps=_NUM_WARPS,
    )  # fmt: skip
    return out
