"""The MoE router's logits in one launch: model-dtype activations against the fp32 gate.

    router_logits(x [T, H] bf16 / fp16 / fp32, w [E, H] fp32) -> [T, E] fp32

The reference (`TopKRouter` on the CPU, and transformers) upcasts x and runs an fp32 GEMM: on
CUDA a cast kernel, cuBLAS's SIMT sgemm and, at decode sizes, its split-K reduction, three
launches for a [T, 64] result. Here one Triton kernel reads x in its dtype, widens it in
registers and multiplies on tensor cores with `tf32x3` (each fp32 operand split into a TF32
high part and a TF32 remainder, three MMAs: about fp32's precision; bf16/fp16 activations are
exact in TF32, so only the gate's low bits round, at ~2^-22 relative). The decode-sized batches
below `ops/gemv.py`'s limit keep the GEMV (one streaming pass, no tensor cores needed).

Grid (cdiv(T, BLOCK_T), cdiv(E, BLOCK_E), S): narrow tiles along E and S splits of K, so that
even a handful of tokens spreads the gate's bytes (512 KB for V2-Lite, 7.3 MB for V3) over every
SM, a few programs each. Prefill-sized batches, which fill the GPU without that, take tiles 64
experts wide (`_tiles`): each x row is then read once per 64 experts, not once per 16, and split
K while those tiles are fewer than _PREFILL_PROGRAMS: a program's K loop is a chain of dependent
steps (32 at V2-Lite's unsplit 2048), so at a few hundred programs its length is the kernel's
time. The S partials go out as they are: the routing kernel sums them in a fixed order
(deterministic, no reduction launch). Both operands of a step are loaded one step ahead (a
register double buffer). No host reads: CUDA-graph safe. T is a runtime mask bound; the tile
choice and Triton's specialisation on T % 16 == 0 make the variants that
`router_logits_variants` lists, for the model to compile at load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["router_logits", "router_logits_variants"]


@triton.jit
def _router_logits_kernel(
    x_ptr, w_ptr, out_ptr, T, x_stride,
    H: tl.constexpr, E: tl.constexpr, KB_PER_SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    mask_t = offs_t < T
    mask_e = offs_e < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    # The gate is a constant: its first tile is loaded before the wait (under PDL its latency
    # overlaps the previous kernel; at decode sizes a split is one tile), each later one a step
    # ahead.
    offs_k = split * KB_PER_SPLIT * BLOCK_K + tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_e[None, :] * H
    w_next = tl.load(
        w_rows + offs_k[:, None], mask=(offs_k < H)[:, None] & mask_e[None, :], other=0.0
    )  # [BLOCK_K, BLOCK_E]
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * x_stride
    wait_for_previous_kernel(PDL)
    a_next = tl.load(
        x_rows + offs_k[None, :], mask=mask_t[:, None] & (offs_k < H)[None, :], other=0.0
    )  # [BLOCK_T, BLOCK_K], the previous kernel's output
    for i in range(KB_PER_SPLIT):
        offs_k = (split * KB_PER_SPLIT + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        a = a_next.to(tl.float32)
        w = w_next
        nk = offs_k + BLOCK_K
        # the split's last step reads nothing (the next split's columns are masked off)
        mask_k = (nk < H) & (i + 1 < KB_PER_SPLIT)
        w_next = tl.load(w_rows + nk[:, None], mask=mask_k[:, None] & mask_e[None, :], other=0.0)
        a_next = tl.load(x_rows + nk[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision="tf32x3")
    out = out_ptr + (split * T + offs_t[:, None].to(tl.int64)) * E + offs_e[None, :]
    tl.store(out, acc, mask=mask_t[:, None] & mask_e[None, :])


_BLOCK_T, _BLOCK_K = 16, 128
# Wide tiles: a [64, 64] fp32 gate tile and the next one in registers at 4 warps.
_WIDE_BLOCK_E, _WIDE_BLOCK_K = 64, 64
# Prefill-sized batches' token rows a tile: each gate tile is read once per 64 tokens, not 16
# (measured: bench/moe_prefill.py --glue, bench/RESULTS.md, "Session of 2026-11-26 (ninth)").
_PREFILL_BLOCK_T = 64
_PROGRAMS_TARGET = 128  # about one per SM of an H100 (132 SMs)
_WIDE_PROGRAMS = 4 * _PROGRAMS_TARGET  # decode-sized wide tiles split K up to this many programs
# Prefill-sized ones up to twice that, in 16-row tiles (a quarter of it in the 64-row tiles
# launched): shorter K chains (measured: bench/moe_prefill.py --glue, bench/RESULTS.md).
_PREFILL_PROGRAMS = 2 * _WIDE_PROGRAMS
_MAX_WIDE_SPLITS = 16
# Decode-sized batches take wide tiles with K split up to this many ways (one 128-wide step a
# program at V2-Lite's 2048) where the gate's bytes per program stay under _LATENCY_BYTES: such
# a launch is a chain of latencies, and a wide tile reads each x row once for 64 experts.
_MAX_SMALL_SPLITS = 16
_LATENCY_BYTES = 32 << 10
# A large gate at decode sizes: tiles 32 experts wide, K split by any divisor of its block count
# (V3's 56: 28, 14, 8 ...) up to this many programs, so that each streams one or two 128-wide
# steps: a program's steps are a dependent chain, and 128 programs of seven steps left V3's gate
# latency-bound (bench/RESULTS.md, thirty-first session).
_NARROW_BLOCK_E = 32
_NARROW_PROGRAMS = 2 * _PROGRAMS_TARGET


def _tiles(num_tokens: int, num_experts: int, hidden: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K, K splits), splits dividing the K blocks' count (a power of
    two but for a large gate's narrow tiles).
    - Prefill-sized batches: wide tiles of _PREFILL_BLOCK_T rows once 16-row ones alone would
      give half _PROGRAMS_TARGET programs, with K split (up to _MAX_WIDE_SPLITS ways) while
      16-row tiles would stay within _PREFILL_PROGRAMS (the 64-row launch within
      2 * _PROGRAMS_TARGET): V2-Lite at 2048 tokens takes 8 splits of 4 steps, at 8192 two.
    - Decode-sized batches of a small gate: wide tiles of 128-wide steps, K split up to
      _MAX_SMALL_SPLITS ways within _WIDE_PROGRAMS, where that leaves <= _LATENCY_BYTES of the
      gate a program: faster than narrow tiles for V2-Lite's and V3's gates where the bytes
      per program stay small, slower past it (bench/RESULTS.md, "Session of 2026-11-26
      (seventh)"; the bound 32 KB since the thirty-first session, where V3's gate at 32-64
      tokens ran faster narrow).
    - Otherwise (a large gate, V3's 7.3 MB, at a few tokens): tiles _NARROW_BLOCK_E experts
      wide with K split by the largest divisor of the K blocks' count that keeps the launch
      within _NARROW_PROGRAMS: a handful of tokens would otherwise stream the whole gate
      through a few SMs, in long chains of dependent loads."""
    t_tiles = triton.cdiv(num_tokens, _BLOCK_T)
    wide = t_tiles * triton.cdiv(num_experts, _WIDE_BLOCK_E)
    if 2 * wide >= _PROGRAMS_TARGET:
        num_kb = triton.cdiv(hidden, _WIDE_BLOCK_K)
        splits = _splits(wide, num_kb, _PREFILL_PROGRAMS, _MAX_WIDE_SPLITS)
        return _PREFILL_BLOCK_T, _WIDE_BLOCK_E, _WIDE_BLOCK_K, splits
    num_kb = triton.cdiv(hidden, _BLOCK_K)
    splits = _splits(wide, num_kb, _WIDE_PROGRAMS, _MAX_SMALL_SPLITS)
    if num_experts * hidden * 4 <= _LATENCY_BYTES * wide * splits:
        return _BLOCK_T, _WIDE_BLOCK_E, _BLOCK_K, splits
    tiles = t_tiles * triton.cdiv(num_experts, _NARROW_BLOCK_E)
    most = min(num_kb, max(1, _NARROW_PROGRAMS // tiles))
    splits = max(d for d in range(1, most + 1) if num_kb % d == 0)
    return _BLOCK_T, _NARROW_BLOCK_E, _BLOCK_K, splits


def _splits(tiles: int, num_kb: int, max_programs: int, max_splits: int) -> int:
    """The K splits of `tiles` tiles over `num_kb` K blocks: the largest power of two that
    divides num_kb, is at most max_splits and keeps tiles * splits <= max_programs (1 at
    least)."""
    splits = 1
    while splits < max_splits and tiles * splits * 2 <= max_programs and num_kb % (splits * 2) == 0:
        splits *= 2
    return splits


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] (unit stride along H), weight [E, H] fp32 contiguous -> split-K partials
    [S, T, E] fp32 whose sum over S (in order) is the logits; `ops.routing.fused_select_experts`
    takes them as they are (`.sum(0)` gives the logits elsewhere)."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.shape[1] != hidden:
        raise ValueError(
            f"router_logits: gate must be contiguous fp32 [E, {hidden}], got "
            f"{weight.dtype} {list(weight.shape)}"
        )
    if num_tokens == 0:  # e.g. a prefill chunk without logits rows (logits_hidden_only)
        return torch.empty(1, 0, num_experts, dtype=torch.float32, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_t, block_e, block_k, splits = _tiles(num_tokens, num_experts, hidden)
    out = torch.empty(splits, num_tokens, num_experts, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_experts, block_e), splits)
    _router_logits_kernel[grid](
        x, weight, out, num_tokens, x.stride(0),
        H=hidden, E=num_experts, KB_PER_SPLIT=triton.cdiv(hidden, block_k) // splits,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
        num_stages=3, **pdl_args(x.device),
    )  # fmt: skip
    return out


def router_logits_variants(num_experts: int, hidden: int) -> list[int]:
    """Token counts that between them compile every variant: each tile choice (the split count
    only falls as T grows, then the tiles widen, their splits fall, and nothing changes past
    _WIDE_PROGRAMS token tiles), each with both of Triton's specialisations of T (a multiple
    of 16 or not)."""
    last = _BLOCK_T * (_PREFILL_PROGRAMS + 2)
    seen, counts = set(), []
    for num_tokens in range(1, last + 1):
        key = (_tiles(num_tokens, num_experts, hidden), num_tokens % 16 == 0)
        if key not in seen:
            seen.add(key)
            counts.append(num_tokens)
    return counts
