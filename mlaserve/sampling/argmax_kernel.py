"""Greedy sampling's argmax over [n, V] logits as two Triton kernels, with the finite check.

    x        [n, V]  float32, rows contiguous
    returns  ids [n] int64: torch.argmax(x, dim=1) wherever the row is finite (ties go to the
             lowest column, as torch's); finite [n] bool: the row's max is finite

Why: torch's argmax reduces a row in one block, so at bs 1 the [1, 102400] logits of a decode
step are one program on one SM, on the GPU's critical path between two steps (measured:
bench/RESULTS.md, "bench/step_gaps.py: what a graphed bs-1 step runs outside its graph").
Here the row is split over ~100 programs (stage 1: each column block's max and its column),
and one program per row reduces the block maxima in block order (stage 2), which keeps torch's
lowest-column tie rule.
Stage 2 also writes the finite flag that greedy rows need (`sampler.finite_rows` gathered the
chosen logit and tested it: two more kernels).

NaN: torch's argmax returns a NaN's column. Here NaN counts as +inf, so a row holding NaN picks
a NaN or +inf column, whose logit is not finite either way: the row is reported as an error and
never turns into a token, as with torch. Finite rows get exactly torch's column.

Launches read no device value on the host: CUDA-graph safe. CUDA only (`argmax_available`);
the interpreter runs it in the CPU tests.
"""

from __future__ import annotations

import torch

try:  # Optional: absent on CPU-only installs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["argmax_available", "fused_argmax", "row_argmax"]

# Columns per stage-1 program: V = 102400 is 100 programs, so one row spreads over the GPU.
_BLOCK = 1024


def argmax_available(device: torch.device) -> bool:
    """Whether the sampler takes `fused_argmax` for tensors on `device`: CUDA with Triton."""
    return triton is not None and device.type == "cuda"


def fused_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, V] float32 -> (ids [n] int64, finite [n] bool); see the module docstring."""
    if triton is None:
        raise RuntimeError("fused_argmax: Triton is not installed")
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"fused_argmax: x must be [n, V] float32, got {x.dtype} {list(x.shape)}")
    x = x.contiguous()
    n, cols = x.shape
    ids = torch.zeros(n, dtype=torch.int64, device=x.device)
    finite = torch.zeros(n, dtype=torch.bool, device=x.device)
    if n == 0 or cols == 0:
        return ids, finite
    blocks = triton.cdiv(cols, _BLOCK)
    best = torch.empty(n, blocks, dtype=torch.float32, device=x.device)
    where = torch.empty(n, blocks, dtype=torch.int64, device=x.device)
    _block_max_kernel[(n, blocks)](x, best, where, cols, blocks, BLOCK=_BLOCK, num_warps=4)
    _row_max_kernel[(n,)](
        best, where, ids, finite, blocks, BLOCKS=triton.next_power_of_2(blocks), num_warps=4
    )
    return ids, finite


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [n, V] -> ids [n] int64: torch.argmax(x, dim=-1) on finite rows; `fused_argmax` where it
    runs (float32 on CUDA), torch's elsewhere. For argmaxes whose finite flag no one reads: the
    draft chain's tokens (a draft from a NaN row is verified like any other) and greedy
    acceptance's target tokens (checked by `sampler.finite_rows`). torch's one block per row
    is slow in the draft graph (bench/RESULTS.md, "Session of 2026-11-26 (fifth)")."""
    if x.dtype == torch.float32 and argmax_available(x.device):
        return fused_argmax(x)[0]
    return x.argmax(dim=-1)


if triton is not None:

    @triton.jit
    def _block_max_kernel(x_ptr, best_ptr, where_ptr, cols, blocks, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * cols + offs, mask=offs < cols, other=float("-inf"))
        v = tl.where(v != v, float("inf"), v)  # NaN counts as +inf (module docstring)
        m, i = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(best_ptr + row * blocks + block, m)
        tl.store(where_ptr + row * blocks + block, block * BLOCK + i.to(tl.int64))

    @triton.jit
    def _row_max_kernel(best_ptr, where_ptr, ids_ptr, finite_ptr, blocks, BLOCKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCKS)
        mask = offs < blocks
        v = tl.load(best_ptr + row * blocks + offs, mask=mask, other=float("-inf"))
        # blocks are in column order, so the leftmost best block holds the lowest best column
        m, b = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(ids_ptr + row, tl.load(where_ptr + row * blocks + b))
        is_finite = (m == m) & (m != float("inf")) & (m != float("-inf"))
        tl.store(finite_ptr + row, is_finite.to(tl.int1))
