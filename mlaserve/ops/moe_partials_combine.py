"""Each token's per-slot fp32 partials summed into the layer's output (`MoePartials`' combine).

    part  [L * T * slots, H]  fp32, slot-major per token, leaf-major with L leaves (the decode
                              and grouped down kernels' output; L = 1 but in the deterministic
                              mode's `moe_decode`)
    y     [T, H]              the model's dtype, written here (fp32: unrounded, a
                              tensor-parallel rank's share before the all-reduce)

The slots are summed in a fixed order (deterministic, unlike atomics), each leaf's alone, the
leaves in the summation tree (`ops/invariant_tree.py`), and rounded once. A leaf module:
`moe_decode`, `moe_grouped` and `moe_partials.MoePartials.total` all call it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.invariant_tree import tree_step
from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["combine_partials"]


@triton.jit
def _leaf_sum(
    part_ptr, row0, offs, mask, H: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr
):
    """One leaf's slots of one token, summed in slot order from part row `row0`."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(SLOTS):  # a fixed order: the same bits on every run
        acc += tl.load(part_ptr + (row0 + slot) * H + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _combine_kernel(
    part_ptr, y_ptr, H: tl.constexpr, SLOTS: tl.constexpr, LEAVES: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    leaf_rows = tl.num_programs(0).to(tl.int64) * SLOTS  # T * slots: one leaf's rows
    wait_for_previous_kernel(PDL)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = _leaf_sum(part_ptr, t * SLOTS, offs, mask, H, SLOTS, BLOCK)
    p1 = acc
    p2 = acc
    p4 = acc
    for c in tl.static_range(1, LEAVES):  # the leaves' tree, in order
        node = _leaf_sum(part_ptr, c * leaf_rows + t * SLOTS, offs, mask, H, SLOTS, BLOCK)
        acc, p1, p2, p4 = tree_step(c, node, p1, p2, p4)
    tl.store(y_ptr + t * H + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def combine_partials(part: torch.Tensor, y: torch.Tensor, slots: int, leaves: int = 1) -> None:
    """part [L * T * slots, H] fp32 -> y [T, H]: each token's partials summed in slot order,
    the L = `leaves` leaves in the summation tree."""
    hidden = y.shape[1]
    block = min(triton.next_power_of_2(hidden), 1024)
    _combine_kernel[(y.shape[0], triton.cdiv(hidden, block))](
        part,
        y,
        H=hidden,
        SLOTS=slots,
        LEAVES=leaves,
        BLOCK=block,
        num_warps=4,
        **pdl_args(y.device),
    )
