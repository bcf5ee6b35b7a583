"""Start-up's kernel warm-up, run on threads: each task compiles one kernel variant (or a few
that must come in order) by running it once on zeros, and a Triton compile spends most of its
time in C++ (MLIR, LLVM) and in ptxas, without the GIL, so tasks on threads compile side by
side. On a cold cache this is most of start-up's compiling; with a filled cache each task loads
its kernels instead.

`KernelWarmUp.start` runs the tasks in the background while start-up goes on (the engine, one
GPU: the KV pool, the throwaway request, the graphs' eager runs); `join` waits for them. What
may be in flight, and why it is safe:
- between `start` and `join` the threads launch kernels on the device's default stream while
  the caller's thread runs forwards on its streams. No CUDA graph may be captured then (a
  capture must see no other thread's launches), so every capture joins first
  (`ModelRunner.join_kernel_warm_up`, called by the graph runners);
- the caching allocator is thread-safe, and the threads' tensors are their own zeros; a task
  that shares a stream with the caller (the MoE's shared-expert side stream) shares only
  values that nothing reads back;
- the device: each thread makes the caller's its current one (CUDA's current device is per
  thread, and Triton launches on the current one);
- Triton's in-memory kernel cache (a dict) and its on-disk cache (files written by rename): two
  threads that reach one variant both compile it, and either result is the same kernel;
- autograd's grad and inference modes (per thread): each thread takes the caller's.
Tasks must not depend on each other's results, and launch their kernels on tensors they make;
every failure is raised by `join`.

With a `KernelCompilePool` (`kernel_compile_pool.py`: a cold cache), `add` first collects on the
caller's thread the kernel variants each task will build and hands them to the pool's worker
processes; a task's thread waits for its variants' compiles, then runs it (loading them from
the disk cache). `wait_compiled` lets the caller wait for every compile before its own forwards,
which would otherwise compile the same variants again on its thread. Under tensor
parallelism the tasks run in order on the caller's thread (`warm_up_concurrently(in_order=
True)`): the MoE's warm-up forward all-reduces, and every rank must issue its collectives in
one order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager

import torch

from mlaserve import triton_key
from mlaserve.kernel_compile_pool import KernelCompilePool, collect, spare_cores

__all__ = ["KernelWarmUp", "warm_up_concurrently"]

MAX_THREADS = 16


class KernelWarmUp:
    """Warm-up tasks running on threads of this process (module doc). `join()` once."""

    def __init__(
        self,
        tasks: Sequence[Callable[[], None]],
        device: torch.device,
        compile_pool: KernelCompilePool | None = None,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"kernel warm-up on threads: a CUDA device, not {device}")
        self.num_tasks = 0
        self.compile_pool = compile_pool
        self._compiles: list[Future[bool]] = []
        self.workers = spare_cores(MAX_THREADS)  # the pool starts them as tasks arrive
        self._start = time.perf_counter()
        self._end = self._start
        self._lock = threading.Lock()
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        # Autograd's modes are per thread too: the threads run under the caller's.
        self._modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            self.workers, thread_name_prefix="kernel-warm-up"
        )
        self._futures: list[Future[None]] = []
        # Before any thread launches: else each computes Triton's key at once (`triton_key.py`).
        triton_key.wait()
        self.add(tasks)

    def add(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Queue more tasks, after those already queued (the threads take them in order)."""
        if self._pool is None:
            raise RuntimeError("kernel warm-up: tasks added after join")
        self.num_tasks += len(tasks)
        if self.compile_pool is None:
            self._futures += [self._pool.submit(self._on_device, task, []) for task in tasks]
            return
        with _modes(*self._modes):
            found = collect(tasks)
        for task, variants in zip(tasks, found, strict=True):
            compiles = [self.compile_pool.submit(v) for v in variants]
            self._compiles += compiles
            self._futures.append(self._pool.submit(self._on_device, task, compiles))

    def _on_device(self, task: Callable[[], None], compiles: list[Future[bool]]) -> None:
        wait(compiles)  # a failed compile: the task compiles here and raises what is wrong
        torch.cuda.set_device(self._index)
        with _modes(*self._modes):
            task()
        with self._lock:
            self._end = time.perf_counter()

    @classmethod
    def start(
        cls,
        tasks: Sequence[Callable[[], None]],
        device: torch.device,
        compile_pool: KernelCompilePool | None = None,
    ) -> KernelWarmUp:
        return cls(tasks, device, compile_pool)

    def wait_compiled(self) -> float:
        """Wait for the compile pool's compiles queued so far -> the seconds waited."""
        t0 = time.perf_counter()
        wait(self._compiles)
        return time.perf_counter() - t0

    @property
    def joined(self) -> bool:
        return self._pool is None

    def join(self) -> None:
        """Wait for every task; re-raises the first failure (after all have ended: no thread
        launches past a failed join)."""
        if self._pool is None:
            raise RuntimeError("kernel warm-up: joined twice")
        pool, self._pool = self._pool, None
        try:
            for future in self._futures:
                future.exception()  # waits; the first failure is raised below, in task order
        finally:
            pool.shutdown(wait=True)
            if self.compile_pool is not None:
                self.compile_pool.shutdown()
        for future in self._futures:
            future.result()

    @property
    def busy_s(self) -> float:
        """Seconds from the start to the last task's end (the threads' share of start-up)."""
        return self._end - self._start


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
    KernelWarmUp.start(calls, device).join()


@contextmanager
def _modes(grad: bool, inference: bool) -> Iterator[None]:
    """Autograd's grad and inference modes (per thread), entered together."""
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        yield
