"""What the split-K kernels that reduce in their last-arriving program share
(`moe_grouped._gate_up_kernel`, `w8a16_gemm._w8a16_wide_kernel`): their arrival counters and
the split count their rules compute, and the arrival itself.

    split_counters(device, tiles) -> [COUNTERS_LEN] int32 on `device`, zero between calls
    k_splits(tiles, k, num_sms, ...) -> splits of K for a grid of `tiles` output tiles
    arrive_last(counter_ptr, SPLIT) / release(counter_ptr): in the kernels (@triton.jit)

A split program stores its fp32 partial, then adds 1 to its output tile's counter (acq_rel, GPU
scope); the one that reads SPLIT - 1 sums the tile's partials in split order (deterministic,
unlike atomics on the output) and writes the counter back to 0. So the buffer is zero whenever
no split kernel runs, and one buffer per device serves every such kernel: made once, on the first
split call (the engine's warm-up, before any graph is captured).

Invariant: split kernels on one device run one at a time. The engine's forwards run on one
stream; the one side stream (a prefill-sized MoE layer's shared experts, `model/layers/moe.py`)
takes only token counts past the FP8 decode GEMMs' (`fp8_gemm.W8A16_MAX_M`, above the wide
kernel's 16 rows), and the grouped MoE kernels never run in a layer that uses it. Two split
kernels at once would count each other's arrivals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["COUNTERS_LEN", "arrive_last", "k_splits", "release", "split_counters"]

COUNTERS_LEN = 1 << 13  # int32 counters a device: more tiles than any split grid holds
_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """`device`'s counters, for a split launch of `tiles` output tiles (one counter each)."""
    if tiles > COUNTERS_LEN:  # the split rules split only grids of a few programs an SM
        raise ValueError(f"split kernel: {tiles} output tiles > {COUNTERS_LEN} arrival counters")
    cnt = _counters.get(device)
    if cnt is None:
        cnt = _counters[device] = torch.zeros(COUNTERS_LEN, dtype=torch.int32, device=device)
    return cnt


def k_splits(
    tiles: int, k: int, num_sms: int, *, split_below: float, programs_per_sm: int,
    max_split: int, min_split_k: int,
) -> int:  # fmt: skip
    """K splits for a grid of `tiles` output tiles: 1 where the tiles make `split_below`
    programs an SM or more, else as many as bring the grid toward `programs_per_sm` programs an
    SM, at most `max_split`, each split at least `min_split_k` keys, lowered until it divides
    K's 128-wide blocks (every split the same whole scale blocks; a K off that grid never
    splits). Host ints only: the grid is fixed per captured graph."""
    if k % 128 or tiles >= split_below * num_sms:
        return 1
    split = max(1, min(-(-programs_per_sm * num_sms // max(tiles, 1)), max_split,
                       k // min_split_k))  # fmt: skip
    while (k // 128) % split:
        split -= 1
    return split


@triton.jit
def arrive_last(counter_ptr, SPLIT: tl.constexpr):
    """Called by a split program once its partial is stored: counts it in at its tile's counter
    (acq_rel, GPU scope, after a CTA barrier so every thread's stores come first) and returns
    whether it was the tile's last, which then reads every split's partial."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT - 1


@triton.jit
def release(counter_ptr):
    """The last program's, once it has summed the partials: the counter is zero again for the
    next call."""
    tl.atomic_xchg(counter_ptr, 0)
