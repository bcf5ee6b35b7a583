"""Rows of a paged fp8 KV cache, gathered by slot and dequantised, in one launch: the context
latent of the MHA-form prefill (`kernels_adapter/mha_extend.gather_context_latent`).

    cache  [N, D] float8_e4m3fn (or its uint8 view), contiguous: a layer's pool, one row a slot
    slots  [S] int64: the rows to read (slot = page * page_size + row)
    scale  float: the layer's per-tensor scale
    out    [S, D] bf16 / fp16 / fp32: out[s] = stored[slots[s]] * scale, the product in fp32
           rounded once to out's dtype (what torch's `rows.to(dtype) * scale` gives: e4m3 ->
           bf16 is exact and torch multiplies a bf16 tensor by a Python float in fp32)

Replaces the byte gather, the e4m3 cast and the scale's multiply: three launches a layer of a
prefill forward, and their gaps, by one. One program per row (576 bytes for DeepSeek).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["gather_dequant"]


@triton.jit
def _gather_dequant_kernel(
    cache_ptr, slot_ptr, out_ptr, scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    wait_for_previous_kernel(PDL)  # the previous kernel wrote the rows (the KV write)
    slot = tl.load(slot_ptr + s)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    raw = tl.load(cache_ptr + slot * D + offs, mask=mask, other=0)
    value = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    tl.store(out_ptr + s.to(tl.int64) * D + offs, value.to(out_ptr.dtype.element_ty), mask=mask)


def gather_dequant(
    cache: torch.Tensor, slots: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """cache [N, D] e4m3 (or uint8), slots [S] int64 -> [S, D] `dtype` (module docstring)."""
    if cache.dim() != 2 or cache.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"gather_dequant: need an e4m3 cache [N, D], got {cache.dtype}")
    if not cache.is_contiguous() or slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError("gather_dequant: need a contiguous cache and int64 slots [S]")
    num_rows, dim = slots.shape[0], cache.shape[1]
    out = torch.empty(num_rows, dim, dtype=dtype, device=cache.device)
    if num_rows:
        _gather_dequant_kernel[(num_rows,)](
            cache.view(torch.uint8), slots, out, scale, D=dim,
            BLOCK_D=triton.next_power_of_2(dim), num_warps=4, **pdl_args(cache.device),
        )  # fmt: skip
    return out
