"""Programmatic dependent launch (PDL, SM90+) for the Triton kernels of the decode step.

Why: at decode batch sizes a step is hundreds of short kernels, and between two of them the GPU
drains the first kernel's last programs, then launches and ramps up the next one. With PDL the
next kernel is launched while the previous one still runs: its programs become resident, do the
work that reads nothing the previous kernel writes (index math, weight loads a kernel issues
first), and block in `griddepcontrol.wait` until the previous grid has finished and its writes
are visible. It shortens small-batch decode replays (bench/RESULTS.md).

Launchers pass `**pdl_args(device)`: the kernel's `PDL` constexpr and Triton's `launch_pdl`
option, always equal (a PDL launch of a kernel compiled without its wait would race). The
contract every kernel launched with PDL keeps:

- it calls `wait_for_previous_kernel(PDL)` in every program, before its first load of anything
  a previous kernel may write (activations, metadata, counters) and before its first store.
  Stores before the wait could overwrite a buffer the previous kernel still reads (the caching
  allocator reuses freed activations), and a program that skipped the wait could let the grid
  end before its predecessor: the next kernel's wait would then not cover the predecessor.
  Weights and other load-time constants may be read before it, and so may what a kernel two
  or more launches back wrote (the step's inputs, a selection the kernel in between reads):
  the previous kernel let this one launch only after its own wait, when its predecessor had
  finished and its writes were visible. Only the immediate predecessor's output needs the
  wait, so a kernel that reads early states which inputs, and its callers keep the writer of
  those out of the launch right before it;
- right after its own wait it lets the next kernel launch (`launch_dependents`). Our kernels are
  one wave at decode sizes, so the next one's programs only take resident slots that are free
  anyway. (Waiting without this early trigger, the next kernel launches as the previous one's
  programs exit, which gains nothing.)

Library kernels mostly launch without the attribute: a PDL kernel after one of them starts when
it completes, and one after a PDL kernel waits for it in full (plain stream order). FlashMLA's
dense SM90 decode kernel (`flash_fwd_splitkv_mla_kernel`, sgl-flash-mla's legacy bf16 path) does
not: it is launched with programmatic stream serialization (so that its combine kernel can start
early) but never calls `cudaGridDependencySynchronize`; it TMA-loads q and reads the cache as
soon as it runs, so after a kernel that triggers early it can read q half written. The kernel
right before every FlashMLA call (`q_prep.py`, or for joined queries W_UK's GEMV in
`head_gemv.py`, which then writes the whole query itself; for the fp8 kernel too, whose launch
we cannot see) therefore waits with `wait_and_hold_next_kernel`: no early trigger, the next
kernel launches when its grid ends (the implicit trigger). Triggering early there made graph
replays differ from eager forwards (bench/RESULTS.md).

CUDA graphs keep the programmatic edges (CUDA >= 12.3). A kernel's profiled duration then
includes its wait: per-kernel profiles under PDL overstate the small kernels (compare replay
times, not kernel tables).

`MLASERVE_PDL=0` turns it off (README, "Switches"; read once per device: benchmarks that
switch in one process call `pdl_launch.cache_clear()` and capture again). The interpreter
(`TRITON_INTERPRET=1`, CPU tests) never uses it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mlaserve import switches
from mlaserve.ops.triton_support import interpreting

__all__ = ["pdl_args", "pdl_launch", "wait_and_hold_next_kernel", "wait_for_previous_kernel"]


@functools.cache
def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability >= 9.0, not the
    interpreter, `MLASERVE_PDL` not "0"."""
    if not switches.pdl() or interpreting():
        return False
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Launch keywords: the kernel's `PDL` constexpr and Triton's `launch_pdl`, both
    `pdl_launch(device)`."""
    pdl = pdl_launch(device)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_and_hold_next_kernel(PDL: tl.constexpr):
    """With PDL: block until the previous kernel in the stream has finished and its writes are
    visible; the next kernel launches only when this grid ends (no early trigger), for a
    successor that reads this kernel's output without waiting (see the module docstring).
    Without: nothing."""
    if PDL:
        gdc_wait()


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With PDL: block until the previous kernel in the stream has finished and its writes are
    visible, then let the next kernel launch. Without: nothing (plain stream order)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
