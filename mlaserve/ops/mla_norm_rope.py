"""Fused MLA prologue: the latent RMSNorm (kv_a_layernorm), RoPE on k_pe and q_pe and, optionally,
the paged KV write (FP8 quantisation included), one launch.

    kv_c     [T, r]        model dtype, last dim contiguous (a split view of kv_a_proj's output)
    k_pe     [T, d_r]      model dtype, last dim contiguous (same)
    q_pe     [T, H, d_r]   model dtype, last dim contiguous (a split view of q_b_proj's output)
    weight   [r]           kv_a_layernorm's weight (params dtype)
    cos/sin  [T, d_r / 2]  fp32, YaRN attention factor applied (`RotaryEmbedding`)
    returns  kv_c_normed [T, r], k_pe_roped [T, d_r], q_pe_roped [T, H, d_r], new contiguous
             tensors in the model dtype (kv_c_normed in result_type(weight, kv_c))

With `kv_cache` [num_pages, page_size, r + d_r] (the pool's layer buffer, fp8_e4m3 / bf16 /
fp16 / fp32), `slot_mapping` [T] int64 and the layer's `kv_scale`, the token's row
`[kv_c_normed | k_pe_roped]` is stored at its slot exactly as `kv_write.write_kv` (and
`MLAKVPool.write`) stores it: rounded to the model dtype, divided by the scale in fp32 and
saturated to +-448 for fp8, cast. kv_c_normed / k_pe_roped are then not returned (None): the
cache is their only consumer on that path.

Per token, the same math and roundings as `RMSNorm` and `apply_rope` (fp32 inside, one rounding
at the end). RoPE's rotation pairs are interleaved `(x0, x1), ...` or halves
`(x_i, x_{i + d/2})`; the output is always `[x1 cos - x2 sin | x2 cos + x1 sin]` (the layout of
`mlaserve/model/layers/rotary.py`). Replaces about 30 small kernels per layer (fp32 upcasts,
strided slices, cat, casts) by one; one program per token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = [
    "NormRopeLaunch",
    "mla_norm_rope",
    "mla_norm_rope_warm_up_tasks",
    "norm_rope_launch",
    "norm_rope_program",
    "rope_pair",
    "warm_up_rows",
]


@triton.jit
def rope_pair(ptr, offs_half, mask, cos, sin, INTERLEAVED: tl.constexpr, HALF: tl.constexpr):
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
def _quantize(x, kv_scale, cache_ptr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Model-dtype values -> the cache dtype, as `MLAKVPool.quantize`."""
    if FP8:
        x = tl.clamp(tl.div_rn(x.to(tl.float32), kv_scale), -FP8_MAX, FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def norm_rope_program(
    t, kv_c_ptr, k_pe_ptr, q_pe_ptr, gamma_ptr, cos_ptr, sin_ptr,
    kv_c_out_ptr, k_pe_out_ptr, q_pe_out_ptr, cache_ptr, slot_ptr, kv_scale,
    kv_c_stride, k_pe_stride, q_pe_stride_t, q_pe_stride_h, q_out_stride_t, q_out_stride_h,
    cs_stride, eps, H,
    R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, WRITE: tl.constexpr, FP8: tl.constexpr,
    FP8_MAX: tl.constexpr, ROPE_Q: tl.constexpr,
):  # fmt: skip
    """Token t's whole prologue (after the PDL wait): also one role of
    `mla_decode_prologue`'s kernel, which ropes q_pe elsewhere when it writes a joined query
    (ROPE_Q off)."""
    if WRITE:
        cache_row = cache_ptr + tl.load(slot_ptr + t).to(tl.int64) * (R + 2 * HALF)

    # Latent RMSNorm: fp32 normalize, round to the model dtype, then scale by the weight.
    offs = tl.arange(0, BLOCK_R)
    mask = offs < R
    c = tl.load(kv_c_ptr + t * kv_c_stride + offs, mask=mask, other=0.0)
    cf = c.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(cf * cf, axis=0) / R + eps)
    y = (cf * rstd).to(c.dtype).to(tl.float32)
    w = tl.load(gamma_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c_out = (w * y).to(kv_c_out_ptr.dtype.element_ty)
    if WRITE:
        tl.store(cache_row + offs, _quantize(c_out, kv_scale, cache_ptr, FP8, FP8_MAX), mask=mask)
    else:
        tl.store(kv_c_out_ptr + t * R + offs, c_out, mask=mask)

    # RoPE on k_pe [d_r] and on every head of q_pe [H, d_r] with this token's cos/sin.
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    cos = tl.load(cos_ptr + t * cs_stride + offs_half, mask=mask_half, other=0.0)
    sin = tl.load(sin_ptr + t * cs_stride + offs_half, mask=mask_half, other=0.0)
    ko1, ko2 = rope_pair(
        k_pe_ptr + t * k_pe_stride, offs_half, mask_half, cos, sin, INTERLEAVED, HALF
    )
    out_k_ty = k_pe_out_ptr.dtype.element_ty
    ko1 = ko1.to(out_k_ty)
    ko2 = ko2.to(out_k_ty)
    if WRITE:
        k_row = cache_row + R
        ko1 = _quantize(ko1, kv_scale, cache_ptr, FP8, FP8_MAX)
        ko2 = _quantize(ko2, kv_scale, cache_ptr, FP8, FP8_MAX)
        tl.store(k_row + offs_half, ko1, mask=mask_half)
        tl.store(k_row + HALF + offs_half, ko2, mask=mask_half)
    else:
        k_out = k_pe_out_ptr + t * (2 * HALF)
        tl.store(k_out + offs_half, ko1, mask=mask_half)
        tl.store(k_out + HALF + offs_half, ko2, mask=mask_half)

    if ROPE_Q:
        offs_h = tl.arange(0, BLOCK_H)
        mask_q = (offs_h[:, None] < H) & mask_half[None, :]
        q_rows = q_pe_ptr + t * q_pe_stride_t + offs_h[:, None] * q_pe_stride_h
        qo1, qo2 = rope_pair(
            q_rows, offs_half[None, :], mask_q, cos[None, :], sin[None, :], INTERLEAVED, HALF
        )
        q_out = q_pe_out_ptr + t * q_out_stride_t + offs_h[:, None] * q_out_stride_h
        out_q_ty = q_pe_out_ptr.dtype.element_ty
        tl.store(q_out + offs_half[None, :], qo1.to(out_q_ty), mask=mask_q)
        tl.store(q_out + HALF + offs_half[None, :], qo2.to(out_q_ty), mask=mask_q)


@triton.jit
def _mla_norm_rope_kernel(
    kv_c_ptr, k_pe_ptr, q_pe_ptr, gamma_ptr, cos_ptr, sin_ptr,
    kv_c_out_ptr, k_pe_out_ptr, q_pe_out_ptr, cache_ptr, slot_ptr, kv_scale,
    kv_c_stride, k_pe_stride, q_pe_stride_t, q_pe_stride_h, q_out_stride_t, q_out_stride_h,
    cs_stride, eps, H,
    R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, WRITE: tl.constexpr, FP8: tl.constexpr,
    FP8_MAX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(PDL)
    norm_rope_program(
        t, kv_c_ptr, k_pe_ptr, q_pe_ptr, gamma_ptr, cos_ptr, sin_ptr,
        kv_c_out_ptr, k_pe_out_ptr, q_pe_out_ptr, cache_ptr, slot_ptr, kv_scale,
        kv_c_stride, k_pe_stride, q_pe_stride_t, q_pe_stride_h, q_out_stride_t, q_out_stride_h,
        cs_stride, eps, H, R, HALF, BLOCK_R, BLOCK_HALF, BLOCK_H, INTERLEAVED, WRITE, FP8,
        FP8_MAX, True,
    )  # fmt: skip


class NormRopeLaunch(NamedTuple):
    """A checked launch of the kernel: its arguments by parameter name (PDL aside), the grid's
    program count (one per token) and what the call returns."""

    args: dict[str, object]
    num_tokens: int
    result: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]


def mla_norm_rope(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    q_pe: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    kv_scale: float = 1.0,
    q_pe_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """-> (kv_a_layernorm(kv_c), rope(k_pe), rope(q_pe)); with `kv_cache`, the first two are
    written to it at `slot_mapping` instead and returned as None. `q_pe_out`: where rope(q_pe)
    goes ([T, H, d_r] in q_pe's dtype, any strides with a contiguous last dim; q_pe itself is
    allowed: each program reads its token's rows before it writes them), else a new tensor.
    See the module docstring."""
    launch = norm_rope_launch(
        kv_c, k_pe, q_pe, weight, eps, cos, sin, interleaved, kv_cache, slot_mapping, kv_scale,
        q_pe_out,
    )  # fmt: skip
    if launch.num_tokens:
        _mla_norm_rope_kernel[(launch.num_tokens,)](**launch.args, **pdl_args(kv_c.device))
    return launch.result


def mla_norm_rope_warm_up_tasks(
    q_strides: tuple[int, int],
    kv_stride: int,
    dims: tuple[int, int, int],
    num_heads: int,
    weight: torch.Tensor,
    interleaved: bool,
    dtype: torch.dtype,
    cache_dtypes: tuple[torch.dtype, ...],
    num_tokens: int,
) -> list[Callable[[], None]]:
    """One task per variant a layer's prefill and wide uniform steps take, each run once on
    `num_tokens` rows of zeros laid out as the projections lay them out (q rows `q_strides`
    (token, head), latent rows [kv_c | k_pe] `kv_stride` apart: Triton specialises on the
    strides' divisibility) in the activations' `dtype`: the MHA prefill's (q_pe roped in place,
    no cache) and the KV-writing one per cache dtype. dims = (d_n, d_r, r)."""
    layout = (q_strides, kv_stride, dims, num_heads, weight, interleaved, dtype)
    return [
        functools.partial(_norm_rope_once, layout, cache_dtype, num_tokens)
        for cache_dtype in (None, *cache_dtypes)
    ]


def warm_up_rows(
    num_tokens: int,
    num_heads: int,
    q_strides: tuple[int, int],
    kv_stride: int,
    dims: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeros laid out as a layer's projections lay them out, for warm-up launches: q [T, H,
    d_n + d_r] with row strides `q_strides`, kv_c [T, r] and k_pe [T, d_r] as views of latent
    rows `kv_stride` apart, and cos [T, d_r / 2] fp32. dims = (d_n, d_r, r)."""
    nope, rope, rank = dims
    q = torch.zeros(num_tokens * q_strides[0], dtype=dtype, device=device)
    q = q.as_strided((num_tokens, num_heads, nope + rope), (*q_strides, 1))
    kv = torch.zeros(num_tokens * kv_stride, dtype=dtype, device=device)
    latent = kv.as_strided((num_tokens, rank + rope), (kv_stride, 1))
    kv_c, k_pe = latent.split([rank, rope], -1)
    cos = torch.zeros(num_tokens, rope // 2, dtype=torch.float32, device=device)
    return q, kv_c, k_pe, cos


def _norm_rope_once(layout: tuple, cache_dtype: torch.dtype | None, num_tokens: int) -> None:
    """One warm-up launch (`mla_norm_rope_warm_up_tasks`'s layout)."""
    q_strides, kv_stride, dims, num_heads, weight, interleaved, dtype = layout
    dev = weight.device
    q, kv_c, k_pe, cos = warm_up_rows(num_tokens, num_heads, q_strides, kv_stride, dims, dtype, dev)
    q_pe = q[..., dims[0] :]
    if cache_dtype is None:  # the MHA prefill's: q_pe roped inside q's own rows
        mla_norm_rope(kv_c, k_pe, q_pe, weight, 1e-6, cos, cos, interleaved, q_pe_out=q_pe)
        return
    cache = torch.zeros(num_tokens, 1, dims[1] + dims[2], dtype=cache_dtype, device=dev)
    slots = torch.arange(num_tokens, device=dev)
    mla_norm_rope(kv_c, k_pe, q_pe, weight, 1e-6, cos, cos, interleaved, cache, slots, 1.0)


def norm_rope_launch(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    q_pe: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    kv_scale: float = 1.0,
    q_pe_out: torch.Tensor | None = None,
) -> NormRopeLaunch:
    """`mla_norm_rope`'s checks and outputs, without the launch (`mla_decode_prologue` runs
    the same programs inside its own kernel). Raises ValueError on inputs that do not fit."""
    num_tokens, r = kv_c.shape
    _, num_heads, dr = q_pe.shape
    if dr % 2 or k_pe.shape != (num_tokens, dr) or cos.shape != (num_tokens, dr // 2):
        raise ValueError(
            f"mla_norm_rope: shapes kv_c {tuple(kv_c.shape)} k_pe {tuple(k_pe.shape)} "
            f"q_pe {tuple(q_pe.shape)} cos {tuple(cos.shape)} do not agree"
        )
    if any(t.stride(-1) != 1 for t in (kv_c, k_pe, q_pe, cos, sin)) or cos.stride() != sin.stride():
        raise ValueError("mla_norm_rope: every input needs a contiguous last dim")
    write = kv_cache is not None
    if write and (
        slot_mapping is None or kv_cache.shape[-1] != r + dr or not kv_cache.is_contiguous()
    ):
        raise ValueError(
            f"mla_norm_rope: kv_cache needs slot_mapping and a contiguous [..., {r + dr}] buffer"
        )
    # On the write path the two outputs are never stored to: 1-row placeholders carry their
    # dtypes (not 0 rows: an empty tensor's null pointer is refused by Triton's launcher).
    rows = 1 if write else num_tokens
    kv_c_out = torch.empty(rows, r, dtype=torch.result_type(weight, kv_c), device=kv_c.device)
    k_pe_out = torch.empty(rows, dr, dtype=k_pe.dtype, device=k_pe.device)
    if q_pe_out is None:
        q_pe_out = torch.empty(num_tokens, num_heads, dr, dtype=q_pe.dtype, device=q_pe.device)
    elif q_pe_out.shape != q_pe.shape or q_pe_out.dtype != q_pe.dtype or q_pe_out.stride(-1) != 1:
        raise ValueError(
            f"mla_norm_rope: q_pe_out {tuple(q_pe_out.shape)} {q_pe_out.dtype} must match q_pe "
            f"{tuple(q_pe.shape)} {q_pe.dtype}, last dim contiguous"
        )
    result = (None, None, q_pe_out) if write else (kv_c_out, k_pe_out, q_pe_out)
    args = {
        "kv_c_ptr": kv_c,
        "k_pe_ptr": k_pe,
        "q_pe_ptr": q_pe,
        "gamma_ptr": weight,
        "cos_ptr": cos,
        "sin_ptr": sin,
        "kv_c_out_ptr": kv_c_out,
        "k_pe_out_ptr": k_pe_out,
        "q_pe_out_ptr": q_pe_out,
        "cache_ptr": kv_cache if write else q_pe_out,
        "slot_ptr": slot_mapping if write else q_pe_out,
        "kv_scale": float(kv_scale),
        "kv_c_stride": kv_c.stride(0),
        "k_pe_stride": k_pe.stride(0),
        "q_pe_stride_t": q_pe.stride(0),
        "q_pe_stride_h": q_pe.stride(1),
        "q_out_stride_t": q_pe_out.stride(0),
        "q_out_stride_h": q_pe_out.stride(1),
        "cs_stride": cos.stride(0),
        "eps": float(eps),
        "H": num_heads,
        "R": r,
        "HALF": dr // 2,
        "BLOCK_R": triton.next_power_of_2(r),
        "BLOCK_HALF": triton.next_power_of_2(dr // 2),
        "BLOCK_H": triton.next_power_of_2(num_heads),
        "INTERLEAVED": interleaved,
        "WRITE": write,
        "FP8": write and kv_cache.dtype == torch.float8_e4m3fn,
        "FP8_MAX": torch.finfo(torch.float8_e4m3fn).max,
        "num_warps": 4,
    }
    return NormRopeLaunch(args, num_tokens, result)
