"""Fused MLA prologue: the latent RMSNorm (kv_a_layernorm) and RoPE on k_pe and q_pe, one launch.

    kv_c     [T, r]        model dtype, last dim contiguous (a split view of kv_a_proj's output)
    k_pe     [T, d_r]      model dtype, last dim contiguous (same)
    q_pe     [T, H, d_r]   model dtype, last dim contiguous (a split view of q_b_proj's output)
    weight   [r]           kv_a_layernorm's weight (params dtype)
    cos/sin  [T, d_r / 2]  fp32, YaRN attention factor applied (`RotaryEmbedding`)
    returns  kv_c_normed [T, r], k_pe_roped [T, d_r], q_pe_roped [T, H, d_r], new contiguous
             tensors in the model dtype (kv_c_normed in result_type(weight, kv_c))

Per token, the same math and roundings as `RMSNorm` and `apply_rope` (fp32 inside, one rounding
at the end). RoPE's rotation pairs are interleaved `(x0, x1), ...` or halves
`(x_i, x_{i + d/2})`; the output is always `[x1 cos - x2 sin | x2 cos + x1 sin]` (the layout of
`mlaserve/model/layers/rotary.py`). Replaces about 30 small kernels per layer (fp32 upcasts,
strided slices, cat, casts) by one; one program per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["mla_norm_rope"]


@triton.jit
def _rope_pair(ptr, offs_half, mask, cos, sin, INTERLEAVED: tl.constexpr, HALF: tl.constexpr):
    if INTERLEAVED:
        x1 = tl.load(ptr + 2 * offs_half, mask=mask, other=0.0)
        x2 = tl.load(ptr + 2 * offs_half + 1, mask=mask, other=0.0)
    else:
        x1 = tl.load(ptr + offs_half, mask=mask, other=0.0)
        x2 = tl.load(ptr + HALF + offs_half, mask=mask, other=0.0)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _mla_norm_rope_kernel(
    kv_c_ptr,
    k_pe_ptr,
    q_pe_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    kv_c_out_ptr,
    k_pe_out_ptr,
    q_pe_out_ptr,
    kv_c_stride,
    k_pe_stride,
    q_pe_stride_t,
    q_pe_stride_h,
    cs_stride,
    eps,
    H,
    R: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)

    # Latent RMSNorm: fp32 normalize, round to the model dtype, then scale by the weight.
    offs = tl.arange(0, BLOCK_R)
    mask = offs < R
    c = tl.load(kv_c_ptr + t * kv_c_stride + offs, mask=mask, other=0.0)
    cf = c.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(cf * cf, axis=0) / R + eps)
    y = (cf * rstd).to(c.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out_c_ty = kv_c_out_ptr.dtype.element_ty
    tl.store(kv_c_out_ptr + t * R + offs, (w * y).to(out_c_ty), mask=mask)

    # RoPE on k_pe [d_r] and on every head of q_pe [H, d_r] with this token's cos/sin.
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    cos = tl.load(cos_ptr + t * cs_stride + offs_half, mask=mask_half, other=0.0)
    sin = tl.load(sin_ptr + t * cs_stride + offs_half, mask=mask_half, other=0.0)
    ko1, ko2 = _rope_pair(
        k_pe_ptr + t * k_pe_stride, offs_half, mask_half, cos, sin, INTERLEAVED, HALF
    )
    k_out = k_pe_out_ptr + t * (2 * HALF)
    out_k_ty = k_pe_out_ptr.dtype.element_ty
    tl.store(k_out + offs_half, ko1.to(out_k_ty), mask=mask_half)
    tl.store(k_out + HALF + offs_half, ko2.to(out_k_ty), mask=mask_half)

    offs_h = tl.arange(0, BLOCK_H)
    mask_q = (offs_h[:, None] < H) & mask_half[None, :]
    q_rows = q_pe_ptr + t * q_pe_stride_t + offs_h[:, None] * q_pe_stride_h
    qo1, qo2 = _rope_pair(
        q_rows, offs_half[None, :], mask_q, cos[None, :], sin[None, :], INTERLEAVED, HALF
    )
    q_out = q_pe_out_ptr + t * H * (2 * HALF) + offs_h[:, None] * (2 * HALF)
    out_q_ty = q_pe_out_ptr.dtype.element_ty
    tl.store(q_out + offs_half[None, :], qo1.to(out_q_ty), mask=mask_q)
    tl.store(q_out + HALF + offs_half[None, :], qo2.to(out_q_ty), mask=mask_q)


def mla_norm_rope(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    q_pe: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (kv_a_layernorm(kv_c), rope(k_pe), rope(q_pe)); shapes in the module docstring."""
    num_tokens, r = kv_c.shape
    _, num_heads, dr = q_pe.shape
    if dr % 2 or k_pe.shape != (num_tokens, dr) or cos.shape != (num_tokens, dr // 2):
        raise ValueError(
            f"mla_norm_rope: shapes kv_c {tuple(kv_c.shape)} k_pe {tuple(k_pe.shape)} "
            f"q_pe {tuple(q_pe.shape)} cos {tuple(cos.shape)} do not agree"
        )
    if any(t.stride(-1) != 1 for t in (kv_c, k_pe, q_pe, cos, sin)) or cos.stride() != sin.stride():
        raise ValueError("mla_norm_rope: every input needs a contiguous last dim")
    kv_c_out = torch.empty(num_tokens, r, dtype=torch.result_type(weight, kv_c), device=kv_c.device)
    k_pe_out = torch.empty(num_tokens, dr, dtype=k_pe.dtype, device=k_pe.device)
    q_pe_out = torch.empty(num_tokens, num_heads, dr, dtype=q_pe.dtype, device=q_pe.device)
    if num_tokens == 0:
        return kv_c_out, k_pe_out, q_pe_out
    _mla_norm_rope_kernel[(num_tokens,)](
        kv_c,
        k_pe,
        q_pe,
        weight,
        cos,
        sin,
        kv_c_out,
        k_pe_out,
        q_pe_out,
        kv_c.stride(0),
        k_pe.stride(0),
        q_pe.stride(0),
        q_pe.stride(1),
        cos.stride(0),
        float(eps),
        num_heads,
        R=r,
        HALF=dr // 2,
        BLOCK_R=triton.next_power_of_2(r),
        BLOCK_HALF=triton.next_power_of_2(dr // 2),
        BLOCK_H=triton.next_power_of_2(num_heads),
        INTERLEAVED=interleaved,
        num_warps=4,
    )
    return kv_c_out, k_pe_out, q_pe_out
