"""Each token's per-slot fp32 partials summed into the layer's output (`MoePartials`' combine).

    part  [T * slots, H]  fp32, slot-major per token (the decode and grouped down kernels' output)
    y     [T, H]          the model's dtype, written here (fp32: unrounded, a tensor-parallel
                          rank's share before the all-reduce)

The slots are summed in a fixed order (deterministic, unlike atomics) and rounded once. A leaf:
`moe_decode`, `moe_grouped` and `moe_partials.MoePartials.total` all call it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["combine_partials"]


@triton.jit
def _combine_kernel(
    part_ptr, y_ptr, H: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(PDL)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(SLOTS):  # a fixed order: the same bits on every run
        acc += tl.load(part_ptr + (t * SLOTS + slot) * H + offs, mask=mask, other=0.0)
    tl.store(y_ptr + t * H + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def combine_partials(part: torch.Tensor, y: torch.Tensor, slots: int) -> None:
    """part [T * slots, H] fp32 -> y [T, H]: each token's partials summed in slot order."""
    hidden = y.shape[1]
    block = min(triton.next_power_of_2(hidden), 1024)
    _combine_kernel[(y.shape[0], triton.cdiv(hidden, block))](
        part,
        y,
        H=hidden,
        SLOTS=slots,
        BLOCK=block,
        num_warps=4,
        **pdl_args(y.device),
    )
