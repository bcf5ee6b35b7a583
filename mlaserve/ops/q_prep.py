"""Fused MLA query preparation for the decode kernels: concatenate and cast in one pass.

    q_nope  [T, H, r]    model dtype, the absorbed query (q_nope @ W_UK); any strides with a
                         contiguous last dim (the bmm's transposed output is fine)
    q_pe    [T, H, d_r]  model dtype, RoPE applied; same rule
    returns [T, H, r + d_r] contiguous, `out_dtype`:
            float8_e4m3fn: saturated to +-448 then cast (round to nearest even), unscaled
                           (the kernel's descale_q is 1), as `q.clamp(-448, 448).to(fp8)`
            bf16 / fp16:   a plain cast

The caller views the result as FlashMLA's `[bs, q_len, H, 576]`. FlashMLA's kernel runs right
after this one and starts without waiting for it, so this kernel lets it launch only when its
own grid has ended (`ops/pdl.py`, `wait_and_hold_next_kernel`). Replaces cat + clamp + cast
(three kernels and two temporaries) by one launch; one program per (token, head).

At decode sizes (<= HEAD_GEMV_MAX_M tokens, the KV written by the layer) W_UK's GEMV writes the
same query itself instead, with the same bits and the same hold (the joined query,
`head_gemv(..., tail=q_pe)`, `FlashMLABackend.forward_joined`): this kernel then does not run.
It remains for larger uniform batches and with `MLASERVE_JOINED_Q=0` (README, "Switches").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_and_hold_next_kernel

__all__ = ["prepare_q"]


@triton.jit
def _prepare_q_kernel(
    q_nope_ptr,
    q_pe_ptr,
    out_ptr,
    H,
    nope_stride_t,
    nope_stride_h,
    pe_stride_t,
    pe_stride_h,
    R: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    # FlashMLA's kernel comes next and reads q without waiting for this grid: no early trigger
    # (`ops/pdl.py`).
    wait_and_hold_next_kernel(PDL)
    t = pid // H
    h = pid % H
    out_row = out_ptr + pid.to(tl.int64) * (R + DR)

    offs = tl.arange(0, BLOCK_R)
    mask = offs < R
    x = tl.load(q_nope_ptr + t * nope_stride_t + h * nope_stride_h + offs, mask=mask, other=0.0)
    offs_pe = tl.arange(0, BLOCK_DR)
    mask_pe = offs_pe < DR
    pe = tl.load(q_pe_ptr + t * pe_stride_t + h * pe_stride_h + offs_pe, mask=mask_pe, other=0.0)
    if FP8:
        x = tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX)
        pe = tl.clamp(pe.to(tl.float32), -FP8_MAX, FP8_MAX)
    tl.store(out_row + offs, x.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + R + offs_pe, pe.to(out_ptr.dtype.element_ty), mask=mask_pe)


def prepare_q(q_nope: torch.Tensor, q_pe: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[T, H, r] + [T, H, d_r] -> [T, H, r + d_r] in `out_dtype` (see the module docstring)."""
    num_tokens, num_heads, r = q_nope.shape
    dr = q_pe.shape[-1]
    if q_pe.shape[:2] != (num_tokens, num_heads):
        raise ValueError(f"q_pe: need [{num_tokens}, {num_heads}, d_r], got {tuple(q_pe.shape)}")
    if q_nope.stride(2) != 1 or q_pe.stride(2) != 1:
        raise ValueError("q_nope / q_pe: the last dim must be contiguous")
    out = torch.empty(num_tokens, num_heads, r + dr, dtype=out_dtype, device=q_nope.device)
    if num_tokens == 0:
        return out
    _prepare_q_kernel[(num_tokens * num_heads,)](
        q_nope,
        q_pe,
        out,
        num_heads,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        R=r,
        DR=dr,
        BLOCK_R=triton.next_power_of_2(r),
        BLOCK_DR=triton.next_power_of_2(dr),
        FP8=out_dtype == torch.float8_e4m3fn,
        FP8_MAX=torch.finfo(torch.float8_e4m3fn).max,
        num_warps=4,
        **pdl_args(q_nope.device),
    )
    return out
