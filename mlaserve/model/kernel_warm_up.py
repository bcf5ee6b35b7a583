"""Start-up's kernel warm-up, run on several threads: each call compiles its kernels' variants
by running them once, and a Triton compile spends most of its time in C++ (MLIR, LLVM) and in
ptxas, without the GIL, so calls on threads compile side by side. On a cold cache this is the
longest phase of start-up (`StartupTimes.kernel_warmup`); with a filled cache each call loads
its kernels instead, which threads also overlap.

What the threads share, and why it is safe:
- the CUDA device: each thread makes the caller's device its current one (CUDA's current device
  is per thread, and Triton launches on the current one);
- the stream: each thread's default stream; the caller synchronises the device afterwards;
- Triton's in-memory kernel cache (a dict) and its on-disk cache (files written by rename): two
  threads that reach one variant both compile it, and either result is the same kernel;
- autograd's grad and inference modes (per thread): each thread takes the caller's.
Calls must not depend on each other's results; every error is raised to the caller.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["warm_up_concurrently"]

MAX_THREADS = 16


def warm_up_concurrently(
    calls: Sequence[Callable[[], None]], device: torch.device, *, in_order: bool = False
) -> None:
    """Run `calls`, on threads where `device` is a GPU (else, or with `in_order`: in order,
    here). Returns when all are done (their GPU work may still be queued); re-raises the first
    failure."""
    if in_order or device.type != "cuda" or len(calls) <= 1:
        for call in calls:
            call()
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(1, min(len(calls), cores or 1, MAX_THREADS))

    # Autograd's modes are per thread too: the threads run under the caller's.
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def on_device(call: Callable[[], None]) -> None:
        torch.cuda.set_device(index)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            call()

    with ThreadPoolExecutor(workers, thread_name_prefix="kernel-warm-up") as pool:
        futures = [pool.submit(on_device, call) for call in calls]
        for future in futures:
            future.result()
