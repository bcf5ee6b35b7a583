"""The deterministic mode's summation tree in a Triton kernel's registers.

`ops/invariant_rowwise.py` defines the tree (`TREE_LEAVES`, `tree_sum`: adjacent pairs summed
level by level, ((l0 + l1) + (l2 + l3)) + ...). A kernel that computes its leaves one after
another, in order, folds each in with `tree_step` and holds at most one pending node per level:

    p1 = p2 = p4 = leaf_0
    node = leaf_0
    for c in tl.static_range(1, LEAVES):
        node, p1, p2, p4 = tree_step(c, leaf_c, p1, p2, p4)
    # node: the root (leaf_0 alone when LEAVES == 1)

The same additions in the same order as `tree_sum`, so the same bits. Up to 8 leaves.

A leaf that is one `tl.dot` from a zero accumulator (one K step) must pass through `settled`
first: Triton's combine pass otherwise folds the tree's `p + dot(a, b, 0)` into
`dot(a, b, p)`, accumulating p inside the MMA, and an FP8 step's `p + part * s` into an FMA,
neither of which is the rounded leaf added (measured on an H200: the default model's o_proj at
8 leaves parted from its TP8 ranks' tree).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["settled", "tree_step"]


@triton.jit
def settled(x, BARRIER: tl.constexpr):
    """x [...] fp32 as it is, behind an identity the compiler cannot see through (BARRIER off:
    under the interpreter, which folds nothing)."""
    if BARRIER:
        out = tl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        out = x
    return out


@triton.jit
def tree_step(c: tl.constexpr, node, p1, p2, p4):
    """Fold leaf `c` (>= 1, in order) into the tree: returns (the node it completes, and the
    pending left nodes of levels 1, 2 and 3 after it). `pN` holds a left child until its right
    sibling is done; leaf c climbs one level per trailing one bit of c."""
    if c % 2 == 0:
        p1 = node
    else:
        node = p1 + node  # level 1: leaves c - 1 and c
        if c % 4 == 1:
            p2 = node
        else:
            node = p2 + node  # level 2
            if c % 8 == 3:
                p4 = node
            else:
                node = p4 + node  # level 3 (c == 7)
    return node, p1, p2, p4
