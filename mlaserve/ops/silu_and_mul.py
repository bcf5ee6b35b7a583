"""Fused SwiGLU activation: [..., 2I] = [gate | up] -> [..., I] = silu(gate) * up.

    x    [T, 2I] bf16 / fp16 / fp32, last dim contiguous (row stride free)
    out  [T, I]  same dtype, contiguous

Same roundings as the torch reference (`F.silu(gate) * up`): silu in fp32 rounded to the dtype,
then the product in fp32 rounded again. Replaces two kernels and an [T, I] temporary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["silu_and_mul"]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, x_stride, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(PDL)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * INTER + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]"""
    if x.dim() != 2 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: need [T, 2I] with a contiguous last dim, got {x.shape}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x,
        out,
        x.stride(0),
        INTER=inter,
        BLOCK=block,
        num_warps=4,
        **pdl_args(x.device),
    )
    return out
