"""The routed experts' gate_up GEMM for prefill-sized MoE batches, x's rows gathered and SiLU-and-mul
applied inside it (bf16 / fp16).

The sorted MoE path (`FusedExperts._forward_sorted`) groups the (token, slot) pairs by expert:

    x       [T, H]       bf16 / fp16, contiguous: the layer's tokens
    order   [R]          int64, R = T * top_k: sorted position -> pair (token pair // top_k)
    counts  [E]          int32: pairs per expert; expert e owns sorted rows
                         [sum(counts[:e]), sum(counts[:e + 1]))
    w13     [E, 2I, H]   x's dtype: gate rows [0, I), up rows [I, 2I) (`FusedExperts`' layout)

    expert_gate_up_silu(x, order, counts, w13) -> h [R, I], sorted rows:
        h_r = silu(x_tok(r) @ gate_e^T) * (x_tok(r) @ up_e^T)

Rounding as the unfused path: gate and up rounded to x's dtype, silu in fp32 rounded, the
product in fp32 rounded. The down GEMM stays `torch._grouped_mm` (faster than this kernel's
form of it at every size measured).

Why not `torch._grouped_mm` + `silu_and_mul` here (the path before this one): the gather of
x's rows, the [R, 2I] gate_up output and the SiLU kernel cost more than the GEMM's tile loses
(measured: bench/moe_prefill.py, bench/RESULTS.md, "Session of 2026-11-26 (ninth)"). At many
rows an expert CUTLASS's larger tiles win, so the MoE layer takes this kernel only up to
`PREFILL_GATE_UP_MAX_ROWS` rows an expert.

One MMA per K step: gate's and up's columns are interleaved in one [BLOCK_K, 2 BLOCK_N] weight
tile, so x's tile is read from shared memory once per step instead of once per projection
(two 64-wide MMAs -> one 128-wide). Same bits, and faster (bench/RESULTS.md, "Session of
2026-11-26 (tenth)", "The gate_up kernel's variants").

Tiles: program `pid` takes M block pid // NUM_N and N block pid % NUM_N, so the programs of one
expert's M blocks run together and its weight tiles are read from HBM once (the rest hits L2).
A block finds its expert from `counts` alone (a cumulative sum of blocks per expert in
registers), so no block -> expert map is built by other launches; blocks past the last expert
exit. The grid is sized from R and E on the host, every constexpr from the model's shapes: no
device value is read, one compiled variant serves every size (CUDA-graph safe).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.ops.fp8_grouped_gemm import max_expert_blocks
from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["PREFILL_GATE_UP_MAX_ROWS", "PrefillGemmTiles", "expert_gate_up_silu"]


class PrefillGemmTiles(NamedTuple):
    block_m: int
    block_n: int  # columns of gate (and as many of up) per program
    block_k: int
    num_warps: int
    num_stages: int


# The sweep's best at 1024-4096 tokens (bench/moe_prefill.py --sweep; 4 warps within 2%).
DEFAULT_TILES = PrefillGemmTiles(128, 64, 64, 8, 3)
# Mean rows an expert up to which the MoE layer takes this kernel (4096 tokens of V2-Lite).
PREFILL_GATE_UP_MAX_ROWS = 384


@triton.jit
def _expert_block(counts_ptr, pid_m, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """-> (expert, sorted rows [BLOCK_M] int64, ok [BLOCK_M], live) of M block pid_m: every
    expert's rows padded to whole blocks, the experts' blocks back to back."""
    bins = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    row_end = tl.cumsum(counts, 0)
    e = tl.sum((block_end <= pid_m).to(tl.int32))
    live = e < E
    mine = bins == e
    first_block = tl.sum(tl.where(mine, block_end - blocks, 0))
    row_start = tl.sum(tl.where(mine, row_end - counts, 0))
    n_e = tl.sum(tl.where(mine, counts, 0))
    local = (pid_m - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = (local < n_e) & live
    return e, (row_start + local).to(tl.int64), ok, live


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, order_ptr, counts_ptr, w_ptr, h_ptr,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, E: tl.constexpr,
    E_PAD: tl.constexpr, NUM_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_m = pid // NUM_N
    wait_for_previous_kernel(PDL)
    e32, rows, ok, live = _expert_block(counts_ptr, pid_m, E, E_PAD, BLOCK_M)
    if live:
        e = e32.to(tl.int64)
        tok = tl.load(order_ptr + rows, mask=ok, other=0) // TOP_K
        n0 = (pid % NUM_N) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < INTER
        offs_k = tl.arange(0, BLOCK_K)
        # One [BLOCK_K, 2 BLOCK_N] weight tile, gate and up columns interleaved (column 2j is
        # gate row n0 + j, 2j + 1 its up row), so one MMA of twice the width reads x's tile once.
        cols = tl.arange(0, 2 * BLOCK_N)
        w_rows = n0 + cols // 2 + (cols % 2) * INTER
        mask_w = (n0 + cols // 2) < INTER
        a_ptrs = x_ptr + tok[:, None] * H + offs_k[None, :]
        w_ptrs = w_ptr + e * (2 * INTER * H) + w_rows[None, :].to(tl.int64) * H + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            mask_k = k0 + offs_k < H
            a = tl.load(a_ptrs, mask=ok[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_w[None, :], other=0.0)
            acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        dtype = h_ptr.dtype.element_ty
        g = acc_g.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        out = (act * acc_u.to(dtype).to(tl.float32)).to(dtype)
        h_ptrs = h_ptr + rows[:, None] * INTER + offs_n[None, :]
        tl.store(h_ptrs, out, mask=ok[:, None] & mask_n[None, :])


def expert_gate_up_silu(
    x: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    w13: torch.Tensor,
    *,
    tiles: PrefillGemmTiles | None = None,
) -> torch.Tensor:
    """x [T, H], order [R] int64, counts [E] int32, w13 [E, 2I, H] -> h [R, I] (sorted rows)."""
    name = "expert_gate_up_silu"
    if x.dtype not in (torch.bfloat16, torch.float16) or w13.dtype != x.dtype:
        raise ValueError(f"{name}: need bf16/fp16 activations and weights of one dtype")
    if not (x.is_contiguous() and w13.is_contiguous()):
        raise ValueError(f"{name}: activations and weights must be contiguous")
    if counts.dtype != torch.int32 or counts.shape != (w13.shape[0],):
        raise ValueError(f"{name}: counts must be int32 [{w13.shape[0]}], got {counts.dtype}")
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    num_rows = order.shape[0]
    if x.shape[1] != hidden or num_rows % max(x.shape[0], 1):
        raise ValueError(f"expert_gate_up_silu: x {list(x.shape)}, {num_rows} rows, H {hidden}")
    h = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return h
    t = tiles or DEFAULT_TILES
    num_n = triton.cdiv(inter, t.block_n)
    grid = (max_expert_blocks(num_rows, num_experts, t.block_m) * num_n,)
    _gate_up_silu_kernel[grid](
        x, order, counts, w13, h,
        H=hidden, INTER=inter, TOP_K=num_rows // x.shape[0], E=num_experts,
        E_PAD=triton.next_power_of_2(num_experts), NUM_N=num_n,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl_args(x.device),
    )  # fmt: skip
    return h
