"""The tensor-parallel all-reduce fused with the residual-add + RMSNorm after it, one launch:

    all_reduce_add_rms_norm(parts, residual, w, eps, exchange)
        parts [T, S, N] fp32: this rank's partial sums (S slots, an MoE layer's, or 1)
        -> (RMSNorm(x + residual) * w, x + residual), x = the sum over the ranks of the sum
           over the slots, rounded once to residual's dtype

the same roundings as `ops.rms_norm.add_partials_rms_norm` on the all-reduced partials. One
program per row; each rank's program for row t:
1. sums its S slots in order (fp32) and stores the row into slot [parity, t, rank] of every
   rank's exchange region (its own by a local store, the peers' over NVLink: peer-mapped
   symmetric memory, no multicast);
2. sets flag [t, rank] of every peer to this call's number (a release at system scope, after a
   CTA barrier, so its stores are visible first) and waits until its own flags [t, r] of every
   peer r reach the same number (acquire);
3. sums slots [parity, t, 0..W-1] in rank order (every rank the same bits), adds the residual,
   normalises (`ops.rms_norm.add_and_normalise`, the unfused norm's own tail).

Exchange region, per rank (`Exchange`): fp32 data [2, ROWS, W, SLOT] then int32 flags [ROWS,
W]; `epochs` [ROWS] int32 counts this rank's calls per row (local memory, written only by that
row's program). The parity (epoch % 2) alternates the data slots, which makes a barrier at the
end unnecessary: a rank writes a slot of parity p again two calls later, which it reaches only
past the next call's flags, i.e. after every peer has finished reading this call's. Flags only
grow (compared as int32 differences: safe across wrap-around, a peer is at most one call ahead).

Invariants: every rank makes the same sequence of calls with the same T (the model's layers are
the same on every rank); calls on one rank are ordered by one stream. A program spins until its
peers arrive: a peer that never comes (a dead rank) hangs it, as any collective would; the
engine's watchdog stops the process group then (`engine/tp_watchdog.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel
from mlaserve.ops.rms_norm import add_and_normalise

__all__ = ["Exchange", "all_reduce_add_rms_norm", "exchange_bytes"]

SLOT = 16384  # fp32 elements a row slot holds: the widest row (ops/rms_norm.py's one block)


def exchange_bytes(rows: int, world: int) -> int:
    """Bytes of one rank's exchange region for `rows` rows on `world` ranks (data and flags)."""
    return 2 * rows * world * SLOT * 4 + rows * world * 4


@dataclass(frozen=True)
class Exchange:
    """This rank's view of the exchange regions (module doc): `bases` [W] int64, each rank's
    region start (peer-mapped device addresses, 16-byte aligned); `epochs` [rows] int32 on this
    device, zero before the first call; every region's flags zero before any rank's first call."""

    rank: int
    world: int
    rows: int
    bases: torch.Tensor
    epochs: torch.Tensor

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world or self.world < 2:
            raise ValueError(f"exchange: rank {self.rank} of {self.world}")
        if self.bases.shape != (self.world,) or self.bases.dtype != torch.int64:
            raise ValueError(f"exchange: bases must be int64 [{self.world}]")
        if self.epochs.shape != (self.rows,) or self.epochs.dtype != torch.int32:
            raise ValueError(f"exchange: epochs must be int32 [{self.rows}]")

    @property
    def row_width(self) -> int:
        """The widest row a slot holds (elements)."""
        return SLOT


@triton.jit
def _all_reduce_rms_norm_kernel(
    parts_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    bases_ptr,
    epochs_ptr,
    res_stride,
    eps,
    rank,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PARTS: tl.constexpr,
    WORLD: tl.constexpr,
    ROWS: tl.constexpr,
    SLOT_N: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    wait_for_previous_kernel(PDL)
    # after the wait: the previous kernel may be this one's last call, still counting
    epoch = tl.load(epochs_ptr + row)
    row64 = row.to(tl.int64)
    x = tl.load(parts_ptr + row64 * PARTS * N + offs, mask=mask, other=0.0)
    for p in tl.static_range(1, PARTS):  # the slots in order, as add_partials_rms_norm
        x += tl.load(parts_ptr + (row64 * PARTS + p) * N + offs, mask=mask, other=0.0)
    parity = (epoch % 2).to(tl.int64)
    slots = (parity * ROWS + row64) * WORLD  # this row's first slot, in SLOT_N units
    flags = 2 * ROWS * WORLD * SLOT_N + row64 * WORLD  # this row's flags, in 4-byte units
    for r in tl.static_range(WORLD):
        base = tl.load(bases_ptr + r).to(tl.pointer_type(tl.float32))
        tl.store(base + (slots + rank) * SLOT_N + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's stores before the release below
    target = epoch + 1
    for r in tl.static_range(WORLD):
        if r != rank:
            peer = tl.load(bases_ptr + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer + flags + rank, target, sem="release", scope="sys")
    mine = tl.load(bases_ptr + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != rank:
            seen = tl.atomic_add(mine + flags + r, 0, sem="acquire", scope="sys")
            while seen - target < 0:
                seen = tl.atomic_add(mine + flags + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # the acquire before every thread's loads below
    tl.store(epochs_ptr + row, target)
    data = tl.load(bases_ptr + rank).to(tl.pointer_type(tl.float32))
    total = tl.load(data + slots * SLOT_N + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for r in tl.static_range(1, WORLD):  # rank order: the same bits on every rank
        total += tl.load(
            data + (slots + r) * SLOT_N + offs, mask=mask, other=0.0, cache_modifier=".cg"
        )
    add_and_normalise(
        total, w, res_ptr, res_stride, out_ptr, res_out_ptr, row64, offs, mask, eps, N, True
    )  # fmt: skip


def all_reduce_add_rms_norm(
    parts: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    exchange: Exchange,
) -> tuple[torch.Tensor, torch.Tensor]:
    """parts [T, S, N] fp32 contiguous, residual [T, N] (bf16 / fp16 / fp32, last dim
    contiguous), weight [N] -> (normed [T, N] in result_type(weight, residual), new residual
    [T, N] in residual's dtype). Every rank of `exchange` calls it with the same T and N, T <=
    exchange.rows, N <= SLOT (module doc)."""
    num_tokens, num_parts, n = parts.shape
    if (
        parts.dtype != torch.float32
        or not parts.is_contiguous()
        or residual.shape != (num_tokens, n)
        or residual.stride(-1) != 1
    ):
        raise ValueError(
            f"all_reduce_add_rms_norm: parts {tuple(parts.shape)} {parts.dtype} (contiguous fp32 "
            f"[T, S, N]) vs residual {tuple(residual.shape)}"
        )
    if num_tokens > exchange.rows or n > SLOT:
        raise ValueError(
            f"all_reduce_add_rms_norm: {num_tokens} rows of {n} past the exchange's "
            f"{exchange.rows} rows of {SLOT}"
        )
    out = torch.empty(
        residual.shape, dtype=torch.result_type(weight, residual), device=parts.device
    )
    res_out = torch.empty(residual.shape, dtype=residual.dtype, device=parts.device)
    if num_tokens == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    _all_reduce_rms_norm_kernel[(num_tokens,)](
        parts, residual, weight, out, res_out, exchange.bases, exchange.epochs,
        residual.stride(0), float(eps), exchange.rank,
        N=n, BLOCK=block, PARTS=num_parts, WORLD=exchange.world, ROWS=exchange.rows,
        SLOT_N=SLOT, num_warps=min(max(block // 256, 1), 16), **pdl_args(parts.device),
    )  # fmt: skip
    return out, res_out
