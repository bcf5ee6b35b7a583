"""Block-scaled FP8 grouped GEMM for the routed experts: rows already sorted by expert.

    grouped_block_fp8_linear(x [R, K], counts [E] int32, W_q [E, N, K] e4m3,
                             S_w [E, N/bn, Kb] fp32) -> [R, N]

Rows [sum(counts[:e]), sum(counts[:e+1])) of x belong to expert e (the layout
`FusedExperts._forward_sorted` builds). On CUDA with Triton the rows are quantised per token and
128-wide group and one Triton kernel (the block-FP8 `fused_moe` design of SGLang/vLLM) runs all
experts (up to GROUPED_W8A16_MAX_ROWS rows, decode sizes, the rows stay unquantised and the
kernel widens the FP8 weight instead: one launch fewer per GEMM, exact activations); `align_blocks` gives it a block -> expert map built with device ops only (static sizes,
no host sync: graph-capturable). Elsewhere (CPU) a loop over experts with the same quantised
activations and dequantised weights; it reads `counts` on the host.

Why Triton and not torch's `F.scaled_grouped_mm`: the routed-expert GEMMs of a decode step have
a handful of rows per expert, the regime where torch's blockwise `scaled_mm` already loses to
bf16 (`fp8_gemm.py`, torch 2.11); a memory-bound kernel that streams each touched
expert's FP8 weight once is what halves the bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mlaserve.ops.fp8_quant import (
    dequantize_weight_block,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_torch,
    triton_available,
)

__all__ = [
    "GROUPED_W8A16_MAX_ROWS",
    "GroupedLayout",
    "align_blocks",
    "grouped_block_fp8_linear",
    "grouped_block_m",
    "grouped_layout",
    "max_expert_blocks",
]


# Up to this many rows (tokens x top_k) the W8A16 form: no activation quantisation launch.
GROUPED_W8A16_MAX_ROWS = 64


def grouped_block_m(num_rows: int) -> int:
    """Rows per kernel block: 16 (tl.dot's minimum) while experts get few rows each."""
    return 16 if num_rows <= 512 else 64


def max_expert_blocks(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most blocks of block_m rows that num_rows rows sorted by expert can take when every
    expert's rows are padded to whole blocks: at most min(E, R) experts have rows and each pads
    fewer than block_m. Known on the host from shapes alone, so a grid sized by it reads no
    device value."""
    return -(-(num_rows + min(num_experts, num_rows) * (block_m - 1)) // block_m)


def align_blocks(
    counts: torch.Tensor, num_rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [E] int (rows per expert, rows sorted by expert) -> (sorted_rows, block_expert).

    Every expert's rows are padded to a multiple of block_m so a kernel block never mixes
    experts; num_blocks = `max_expert_blocks(R, E, block_m)`.
        sorted_rows  [num_blocks * block_m] int32: slot -> row of x, R for an empty slot
        block_expert [num_blocks] int32: block -> expert, -1 for a block past the last row"""
    num_experts = counts.shape[0]
    device = counts.device
    counts = counts.to(torch.int64)
    num_blocks = max_expert_blocks(num_rows, num_experts, block_m)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    rows = torch.arange(num_rows, device=device)
    # Expert of each (sorted) row: the number of experts whose rows end at or before it.
    row_expert = torch.searchsorted(counts.cumsum(0), rows, right=True)
    slot = padded_start[row_expert] + rows - start[row_expert]
    sorted_rows = torch.full((num_blocks * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_rows.scatter_(0, slot, rows.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_rows, block_expert


class GroupedLayout(NamedTuple):
    """`align_blocks`' block -> expert map for one routing, shared by the GEMMs that use it
    (an MoE's gate_up and down run on the same rows)."""

    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def grouped_layout(counts: torch.Tensor, num_rows: int) -> GroupedLayout:
    block_m = grouped_block_m(num_rows)
    return GroupedLayout(*align_blocks(counts, num_rows, block_m), block_m)


def grouped_block_fp8_linear(
    x: torch.Tensor,
    counts: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    *,
    emulated: bool | None = None,
    layout: GroupedLayout | None = None,
    w8a16: bool | None = None,
) -> torch.Tensor:
    """x [R, K] rows grouped by expert, counts [E], W_q [E, N, K], S_w [E, N/bn, Kb] -> [R, N]
    in x's dtype. `emulated` forces the loop (True) or the kernel (False); None: kernel on CUDA
    with Triton. `layout`: `grouped_layout(counts, R)` if the caller already has it. `w8a16`
    forces the activation form; None: W8A16 in the kernel up to GROUPED_W8A16_MAX_ROWS rows,
    W8A8 otherwise and in the emulated loop."""
    if emulated is None:
        emulated = not (x.is_cuda and triton_available())
    num_rows = x.shape[0]
    if w8a16 is None:  # the emulated loop keeps W8A8's math, as block_fp8_linear's does
        w8a16 = not emulated and num_rows <= GROUPED_W8A16_MAX_ROWS
    if emulated:
        if w8a16:
            x_deq = x.float()
        else:
            x_q, x_s = per_token_group_quant_fp8_torch(x)
            x_deq = dequantize_weight_block(x_q, x_s)
        out = x.new_empty(num_rows, w_q.shape[1])
        start = 0
        for e, n in enumerate(counts.tolist()):  # host sync: the CPU path only
            if n:
                w = dequantize_weight_block(w_q[e], w_s[e])
                out[start : start + n] = (x_deq[start : start + n] @ w.t()).to(x.dtype)
                start += n
        return out
    from mlaserve.ops.fp8_triton import grouped_block_fp8_matmul_triton

    if layout is None:
        layout = grouped_layout(counts, num_rows)
    x_q, x_s = (x, None) if w8a16 else per_token_group_quant_fp8(x)
    return grouped_block_fp8_matmul_triton(
        x_q, x_s, w_q, w_s, layout.sorted_rows, layout.block_expert, layout.block_m, x.dtype
    )
