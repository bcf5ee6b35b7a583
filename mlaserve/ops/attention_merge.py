"""Split-KV's merge: attention partials over disjoint key sets combined by their log-sum-exp, in
one launch (`kernels_adapter/prefix_split.py`: a prefix-cache hit's prefix chunks and its new
tokens).

    pre      [P * n, H, Dp]  P partials of the same n query rows, partial p at rows p*n .. p*n+n-1;
                             last dim contiguous, any row / head strides
    lse_pre  [H, P * n]      fp32, natural log, each partial's log-sum-exp of its scaled scores
    new      [n, H, Dp]      one more partial (the new tokens' own keys), strides as `pre`
    lse_new  [H, n]          fp32
    returns  [n, H, d_v]     new, contiguous, in `new`'s dtype: the first d_v <= Dp columns of
                             sum_p exp(lse_p - m) part_p / sum_p exp(lse_p - m), m = max_p lse_p

Why one kernel: torch spells the merge in a dozen launches per layer (cat, view, max, exp,
products, sums), and a hit's attention runs eagerly between piecewise graphs, where each launch
is host time. n, P and the strides are runtime values (not specialised), so one compile per
model (heads and widths) serves every hit; the backend compiles it at construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["merge_attention"]


@triton.jit(
    do_not_specialize=["n", "P", "pre_s", "pre_h", "new_s", "new_h", "lse_pre_h", "lse_new_h"]
)
def _merge_kernel(
    pre_ptr, lse_pre_ptr, new_ptr, lse_new_ptr, out_ptr, n, P,
    pre_s, pre_h, new_s, new_h, lse_pre_h, lse_new_h,
    H: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)  # query row
    h = tl.program_id(1)  # head
    cols = tl.arange(0, BLOCK_D)
    mask = cols < DV
    lse_new = tl.load(lse_new_ptr + h * lse_new_h + i)
    top = lse_new
    p = 0
    while p < P:  # a while loop: P is a runtime bound, on the GPU and under the interpreter
        top = tl.maximum(top, tl.load(lse_pre_ptr + h * lse_pre_h + p * n + i))
        p += 1
    weight = tl.exp(lse_new - top)
    row = tl.load(new_ptr + i.to(tl.int64) * new_s + h * new_h + cols, mask=mask, other=0.0)
    acc = weight * row.to(tl.float32)
    total = weight
    p = 0
    while p < P:
        w = tl.exp(tl.load(lse_pre_ptr + h * lse_pre_h + p * n + i) - top)
        r = (p * n + i).to(tl.int64)
        row = tl.load(pre_ptr + r * pre_s + h * pre_h + cols, mask=mask, other=0.0)
        acc += w * row.to(tl.float32)
        total += w
        p += 1
    out = out_ptr + (i.to(tl.int64) * H + h) * DV + cols
    tl.store(out, (acc / total).to(out_ptr.dtype.element_ty), mask=mask)


def merge_attention(
    pre: torch.Tensor,
    lse_pre: torch.Tensor,
    new: torch.Tensor,
    lse_new: torch.Tensor,
    num_chunks: int,
    d_v: int,
) -> torch.Tensor:
    """-> [n, H, d_v] (see the module docstring). Raises ValueError on inputs that do not fit."""
    n, heads, width = new.shape
    fits = (
        pre.dim() == 3 and tuple(pre.shape) == (num_chunks * n, heads, width)
        and tuple(lse_pre.shape) == (heads, num_chunks * n) and tuple(lse_new.shape) == (heads, n)
        and 0 < d_v <= width and num_chunks >= 1
    )  # fmt: skip
    if not fits:
        raise ValueError(
            f"merge_attention: pre {list(pre.shape)}, lse_pre {list(lse_pre.shape)}, new "
            f"{list(new.shape)}, lse_new {list(lse_new.shape)} do not fit {num_chunks} chunks "
            f"of [n, H, Dp] with d_v = {d_v}"
        )
    if lse_pre.dtype != torch.float32 or lse_new.dtype != torch.float32:
        raise ValueError("merge_attention: the log-sum-exps must be float32")
    if (
        pre.stride(-1) != 1
        or new.stride(-1) != 1
        or lse_pre.stride(-1) != 1
        or lse_new.stride(-1) != 1
    ):
        raise ValueError("merge_attention: every input needs a contiguous last dim")
    out = torch.empty(n, heads, d_v, dtype=new.dtype, device=new.device)
    if n == 0:
        return out
    _merge_kernel[(n, heads)](
        pre, lse_pre, new, lse_new, out, n, num_chunks,
        pre.stride(0), pre.stride(1), new.stride(0), new.stride(1),
        lse_pre.stride(0), lse_new.stride(0),
        H=heads, DV=d_v, BLOCK_D=triton.next_power_of_2(d_v), num_warps=4,
    )  # fmt: skip
    return out
