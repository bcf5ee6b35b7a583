"""Fused paged-KV write: quantize the new tokens' latent KV and store it at their slots.

    kv_c          [T, r]       model dtype (bf16/fp16/fp32), rows may be strided (a split view)
    k_pe          [T, d_r]     model dtype, RoPE applied
    slot_mapping  [T] int64    global slot = page * page_size + row
    kv_buffer     [num_pages, page_size, r + d_r] cache dtype (contiguous):
                  float8_e4m3fn, bf16, fp16 or fp32

Row `slot_mapping[t]` of the flattened buffer becomes `[kv_c[t] | k_pe[t]]`. For fp8 the value
is divided by the layer's per-tensor `scale` in fp32 and saturated to +-448 before the cast, so
it equals `MLAKVPool.quantize` bit for bit (the torch reference path); other dtypes store the
values (cast, scale ignored as in the pool). One program per token; nothing else is touched,
so rows that are not written keep whatever they held.

Replaces, per layer: cat, float(), /scale, clamp, to(fp8), uint8 view and index_copy_ (about
6 kernels and 3 temporaries) by one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["write_kv"]


@triton.jit
def _write_kv_kernel(
    kv_c_ptr,
    k_pe_ptr,
    slot_ptr,
    out_ptr,
    kv_c_stride,
    k_pe_stride,
    scale,
    R: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0)
    wait_for_previous_kernel(PDL)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = out_ptr + slot * (R + DR)

    offs = tl.arange(0, BLOCK_R)
    mask = offs < R
    c = tl.load(kv_c_ptr + t * kv_c_stride + offs, mask=mask, other=0.0).to(tl.float32)
    offs_pe = tl.arange(0, BLOCK_DR)
    mask_pe = offs_pe < DR
    pe = tl.load(k_pe_ptr + t * k_pe_stride + offs_pe, mask=mask_pe, other=0.0).to(tl.float32)
    if FP8:
        # x / scale rounded as torch rounds it (IEEE division; `/` may lower to an approximate one).
        c = tl.clamp(tl.div_rn(c, scale), -FP8_MAX, FP8_MAX)
        pe = tl.clamp(tl.div_rn(pe, scale), -FP8_MAX, FP8_MAX)
    tl.store(row + offs, c.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(row + R + offs_pe, pe.to(out_ptr.dtype.element_ty), mask=mask_pe)


def write_kv(
    kv_buffer: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """Store [kv_c | k_pe] (divided by `scale` and saturated for fp8) at `slot_mapping`."""
    num_tokens, r = kv_c.shape
    dr = k_pe.shape[1]
    if kv_buffer.shape[-1] != r + dr or not kv_buffer.is_contiguous():
        raise ValueError(
            f"kv_buffer: need a contiguous [..., {r + dr}] buffer, got {tuple(kv_buffer.shape)}"
        )
    if kv_c.stride(1) != 1 or k_pe.stride(1) != 1:
        raise ValueError("kv_c / k_pe: the last dim must be contiguous")
    if num_tokens == 0:
        return
    fp8 = kv_buffer.dtype == torch.float8_e4m3fn
    _write_kv_kernel[(num_tokens,)](
        kv_c,
        k_pe,
        slot_mapping,
        kv_buffer,
        kv_c.stride(0),
        k_pe.stride(0),
        float(scale),
        R=r,
        DR=dr,
        BLOCK_R=triton.next_power_of_2(r),
        BLOCK_DR=triton.next_power_of_2(dr),
        FP8=fp8,
        FP8_MAX=torch.finfo(torch.float8_e4m3fn).max,
        num_warps=4,
        **pdl_args(kv_c.device),
    )
