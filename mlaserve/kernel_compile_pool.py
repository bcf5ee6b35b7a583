"""Start-up's Triton compiles on worker processes: the kernel variants the warm-up tasks
(`kernel_warm_up.py`) will launch, compiled side by side into Triton's on-disk cache, so that the
tasks then load them instead of compiling.

Why processes and not the tasks' threads: a Triton compile's front end (Python, from the AST to
TTIR) and its C launcher's generation hold the GIL, so threads compile little more than one at
a time (bench/RESULTS.md, "Session of 2026-11-29 (twenty-fifth)": the default model's 124
variants took 12.6-14.1 s on 15 threads of an H200 host and 4.5-6.0 s on 15 processes).

How, and what each step may touch:
1. `start_compile_server()`, early in the engine process (before torch's import, which it
   overlaps): multiprocessing's fork server, which imports torch and Triton once; workers fork
   from it in milliseconds. The server never touches the device, so its children hold no CUDA
   state; it inherits this process's environment (the NCCL and cache variables included).
2. `collect(tasks)`: each task run on the calling thread with Triton's `jit_cache_hook`
   answering "skip" there (and only there: other threads compile and launch as usual). Every
   kernel variant the task would build is recorded, by its module, name and Triton's own
   specialisation data, and neither compiled nor launched. torch's operators launch nothing
   either (`device_dry_run.py`): they would read what the skipped kernels did not write (a
   garbage offset fed to `torch._grouped_mm` asserted on the device and ended a V3-lite start).
   Warm-up tasks launch their kernels on tensors they made (`kernel_warm_up.py`'s rule), so
   nothing outside them changes; a task that stops or fails half-way keeps what it recorded,
   and compiles the rest, or fails again with its real error, when it runs.
3. `KernelCompilePool.submit(variant)`: the variant compiled on a worker with this process's
   target, cache-invalidating environment and cache folder, so it is stored under the key this
   process computes at the launch; the worker then builds its C launcher too (a C compile,
   cached by Triton as well). A variant already on disk costs the worker a lookup.
The pool runs on one GPU when start-up found Triton's cache empty (a cold host, `mlaserve
precompile`): a filled cache loads faster than the server starts. `MLASERVE_COMPILE_PROCESSES=0`
turns it off, for A/B runs.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlaserve import switches

__all__ = [
    "KernelCompilePool",
    "Variant",
    "collect",
    "compile_processes_wanted",
    "main_hidden",
    "spare_cores",
    "start_compile_server",
    "stop_compile_server",
    "triton_cache_is_empty",
]

logger = logging.getLogger(__name__)

# What the fork server imports once for every worker (the kernels' modules import torch).
_PRELOAD = ["torch", "triton", "triton.compiler", "mlaserve.ops"]
MAX_WORKERS = 16


@dataclass(frozen=True)
class Variant:
    """One Triton kernel variant: its `@triton.jit` function's module and name, and Triton's
    specialisation data (JSON: signature, constexprs, attributes, options; what
    `JITFunction.preload` takes)."""

    module: str
    name: str
    specialization: str


def spare_cores(limit: int) -> int:
    """One worker per core this process may run on but the caller's (which goes on with
    start-up), at least 1 and at most `limit`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min((cores or 1) - 1, limit))


def triton_cache_dir() -> Path:
    """The folder Triton caches compiled kernels in (`TRITON_CACHE_DIR`, else its default)."""
    explicit = os.environ.get("TRITON_CACHE_DIR")
    if explicit:
        return Path(explicit)
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    return Path(home) / ".triton" / "cache"


def triton_cache_is_empty() -> bool:
    """Whether Triton's cache holds no kernel yet (missing or empty): a start that compiles."""
    folder = triton_cache_dir()
    try:
        return next(folder.iterdir(), None) is None
    except OSError:
        return True


def compile_processes_wanted(device: str, tp_size: int) -> bool:
    """Whether start-up compiles on processes: one GPU, the switches on, an empty cache.
    `device`: "cuda[:N]", "cpu", or "auto" (before torch's import: a CUDA device node)."""
    cuda = Path("/dev/nvidiactl").exists() if device == "auto" else device.startswith("cuda")
    return (
        cuda
        and tp_size == 1
        and switches.compile_processes()
        and switches.background_warm_up()
        and triton_cache_is_empty()
    )


_server_lock = threading.Lock()
_server_started = False


def start_compile_server() -> None:
    """Start the fork server (its imports run beside this process's start-up); idempotent."""
    global _server_started
    with _server_lock:
        if _server_started:
            return
        multiprocessing.set_forkserver_preload(_PRELOAD)
        from multiprocessing import forkserver

        with main_hidden():
            forkserver.ensure_running()
        _server_started = True


@contextmanager
def main_hidden() -> Iterator[None]:
    """`__main__` without its file and spec while a process starts: multiprocessing's `spawn`
    and `forkserver` would have the child run this process's main script again. The compile
    server and its workers start so (a user's script need not guard its top level, and they
    need mlaserve's kernel modules alone)."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


def stop_compile_server() -> None:
    """Stop the fork server once start-up's compiles are done (it holds torch's imports)."""
    global _server_started
    with _server_lock:
        if not _server_started:
            return
        from multiprocessing import forkserver

        # `_stop` is the standard library's own (its tests stop the server with it); without
        # it the idle server lives until this process exits.
        stop = getattr(forkserver._forkserver, "_stop", None)
        if stop is not None:
            stop()
        _server_started = False


# ----- collection -----

_collecting = threading.local()  # .variants: the list the calling thread records into
_hook_lock = threading.Lock()
_hook_installed = False


def _install_hook() -> None:
    """Triton's `jit_cache_hook`, chained to any hook already installed: on a collecting thread
    it records the variant and returns True (Triton then neither compiles nor launches)."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        from triton import knobs

        previous = knobs.runtime.jit_cache_hook

        def hook(*args: Any, **kwargs: Any) -> Any:
            variants = getattr(_collecting, "variants", None)
            if variants is not None:
                fn = kwargs["fn"]
                spec = kwargs["compile"]["specialization_data"]
                variants.append(Variant(fn.module, fn.name, spec))
                return True
            return previous(*args, **kwargs) if previous is not None else None

        knobs.runtime.jit_cache_hook = hook
        _hook_installed = True


def collect(tasks: Sequence[Callable[[], None]]) -> list[list[Variant]]:
    """The kernel variants each task would build, nothing launched (module doc, step 2)."""
    from mlaserve.device_dry_run import DeviceDryRun, DryRunStopped

    _install_hook()
    found: list[list[Variant]] = []
    for task in tasks:
        _collecting.variants = variants = []
        try:
            with DeviceDryRun("cuda"):
                task()
        except Exception as e:  # the task compiles the rest, or raises this for real, when it runs
            how = "stopped" if isinstance(e, DryRunStopped) else "failed"
            logger.debug(
                "kernel collection: a task %s after %d variants: %s", how, len(variants), e
            )
        finally:
            _collecting.variants = None
        found.append(variants)
    return found


# ----- compiling -----


class KernelCompilePool:
    """Worker processes forked from the compile server, compiling `Variant`s (module doc,
    step 3). `submit` may be called from any thread; `shutdown()` once."""

    def __init__(self, workers: int | None = None) -> None:
        from triton import knobs
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.runtime.driver import driver

        start_compile_server()
        target = driver.active.get_current_target()
        self._context = (
            (target.backend, target.arch, target.warp_size),
            get_cache_invalidating_env_vars(),
            knobs.cache.dir,
        )
        self.workers = workers or spare_cores(MAX_WORKERS)
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("forkserver")
        )
        self._lock = threading.Lock()
        self._futures: dict[Variant, Future[bool]] = {}

    def submit(self, variant: Variant) -> Future[bool]:
        """The variant's compile (one per variant, however often submitted) -> whether the
        worker compiled it (False: it was on disk already)."""
        with self._lock:
            future = self._futures.get(variant)
            if future is None:
                if self._pool is None:
                    raise RuntimeError("kernel compile pool: submit after shutdown")
                with main_hidden():  # the pool forks a worker here while it has fewer
                    future = self._pool.submit(_compile, variant, *self._context)
                self._futures[variant] = future
            return future

    @property
    def num_variants(self) -> int:
        return len(self._futures)

    def num_compiled(self) -> int:
        """Variants the workers compiled (not found on disk), of those done without error."""
        done = [f for f in self._futures.values() if f.done() and f.exception() is None]
        return sum(f.result() for f in done)

    def failures(self) -> list[tuple[Variant, BaseException]]:
        return [(v, e) for v, f in self._futures.items() if f.done() and (e := f.exception())]

    def shutdown(self) -> None:
        """Wait for the workers, then stop them and the compile server."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        stop_compile_server()


def _compile(
    variant: Variant,
    target: tuple[str, Any, int],
    env_vars: dict[str, str],
    cache_dir: str,
) -> bool:
    """On a worker: `JITFunction.preload`'s steps without a device (a forked worker must not
    touch CUDA), then the C launcher. -> whether Triton compiled (False: a cache hit)."""
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.driver import driver
    from triton.runtime.jit import convert_to_tuple_if_list

    knobs.cache.dir = cache_dir
    fn = importlib.import_module(variant.module)
    for part in variant.name.split("."):
        fn = getattr(fn, part)
    data = json.loads(variant.specialization)
    constexprs = {
        tuple(k): (
            tl.dtype(v)
            if tl.dtype.is_dtype(v)
            else tl.constexpr(v["constexpr"])
            if isinstance(v, dict) and "constexpr" in v
            else v
        )
        for k, v in zip(data["constant_keys"], data["constant_vals"], strict=True)
    }
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"], strict=True)}
    signature = {k: convert_to_tuple_if_list(v) for k, v in data["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    gpu = GPUTarget(*target)
    options = make_backend(gpu).parse_options(options)
    hit: list[bool] = []
    previous = knobs.compilation.listener
    knobs.compilation.listener = lambda **kw: hit.append(bool(kw.get("cache_hit")))
    try:
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=gpu,
            options=options.__dict__,
            _env_vars=env_vars,
        )
    finally:
        knobs.compilation.listener = previous
    driver.active.launcher_cls(kernel.src, kernel.metadata)
    return not (hit and hit[0])
