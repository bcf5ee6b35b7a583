"""The rotary embedding's cos and sin at a forward's positions, in one kernel.

    positions  [T] int64
    inv_freq   [D] fp32, contiguous (D = rope_dim / 2)
    returns    cos, sin [T, D] fp32, contiguous: cos(p * f) * factor, sin(p * f) * factor

The torch reference (`model/layers/rotary.py: RotaryEmbedding.forward`) launches six kernels a
forward (the cast, the outer product, cos, sin, two scalings), at the head of every decode step;
here one, with the same bits: the same fp32 products, and CUDA's cosf / sinf (libdevice), the
functions torch's kernels call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["rotary_cos_sin"]

_BLOCK_T = 16


@triton.jit(do_not_specialize=["T"])  # one variant for every token count
def _rotary_cos_sin_kernel(
    pos_ptr, freq_ptr, cos_ptr, sin_ptr, T, factor,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_d = offs_d < D
    freq = tl.load(freq_ptr + offs_d, mask=mask_d, other=0.0)  # a constant: before the wait
    wait_for_previous_kernel(PDL)  # the positions come from the step's fill
    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0).to(tl.float32)
    x = pos[:, None] * freq[None, :]
    out = offs_t[:, None] * D + offs_d[None, :]
    mask = mask_t[:, None] & mask_d[None, :]
    if LIBDEVICE:  # CUDA's cosf / sinf, as torch's kernels
        c, s = libdevice.cos(x), libdevice.sin(x)
    else:  # the interpreter (CPU tests): numpy's
        c, s = tl.cos(x), tl.sin(x)
    tl.store(cos_ptr + out, c * factor, mask=mask)
    tl.store(sin_ptr + out, s * factor, mask=mask)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] int64 positions, [D] fp32 inverse frequencies -> (cos, sin) [T, D] fp32."""
    if positions.dim() != 1 or positions.dtype != torch.int64:
        raise ValueError(
            f"rotary_cos_sin: positions must be [T] int64, got {positions.shape} {positions.dtype}"
        )
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous():
        raise ValueError("rotary_cos_sin: inv_freq must be a contiguous [D] fp32 tensor")
    num_tokens, dim = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(num_tokens, dim, dtype=torch.float32, device=inv_freq.device)
    sin = torch.empty_like(cos)
    if num_tokens:
        _rotary_cos_sin_kernel[(triton.cdiv(num_tokens, _BLOCK_T),)](
            positions.contiguous(), inv_freq, cos, sin, num_tokens, float(factor),
            D=dim, BLOCK_T=_BLOCK_T, BLOCK_D=triton.next_power_of_2(dim), num_warps=4,
            LIBDEVICE=inv_freq.is_cuda, **pdl_args(inv_freq.device),
        )  # fmt: skip
    return cos, sin
