"""Arrival counters of the split-K kernels that reduce in their last-arriving program
(`moe_grouped._gate_up_kernel`, `w8a16_gemm._w8a16_wide_kernel`).

    split_counters(device, tiles) -> [COUNTERS_LEN] int32 on `device`, zero between calls

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

__all__ = ["COUNTERS_LEN", "split_counters"]

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
