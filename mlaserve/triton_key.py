"""Triton's own cache key, computed once per process on a thread of its own, before the kernel
warm-up's threads need it.

Every Triton kernel's first launch in a process, compiled or loaded from the disk cache, asks
for `triton.runtime.cache.triton_key()`: a SHA-256 over Triton's compiler and language sources
and over libtriton.so (hundreds of MB). It is memoised by `functools.lru_cache`, which does not
lock, so the warm-up's threads (`model/kernel_warm_up.py`), reaching their first kernels
together with the main thread, each computed it: on a warm start of the default model this was
most of the throwaway request's time (bench/RESULTS.md, "twenty-sixth"). `start()` computes it
once, beside the engine's construction (reading and hashing libtriton.so release the GIL);
`wait()` joins that before the threads start.

`start()` needs Triton already imported on the calling thread: importing a package on two
threads at once can deadlock in Python's import locks (thread A imports `triton` whose
`__init__` wants `triton.runtime.cache`, which thread B holds while it waits for `triton`).

Layer 3 (README, "Layers"): nothing from mlaserve.
"""

from __future__ import annotations

import logging
import sys
import threading

__all__ = ["start", "wait"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_thread: threading.Thread | None = None


def _compute() -> None:
    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception as e:  # the first launch computes it again, and raises there
        logger.debug("Triton's cache key, computed ahead: %s", e)


def start() -> None:
    """Compute Triton's key on a daemon thread (idempotent); nothing where Triton is not
    imported yet (see the module doc) or not installed."""
    global _thread
    with _lock:
        if _thread is not None or "triton" not in sys.modules:
            return
        _thread = threading.Thread(target=_compute, name="triton-key", daemon=True)
        _thread.start()


def wait() -> None:
    """Return once Triton's key is memoised: joins `start()`'s thread, or starts it first. A
    failure there is left to the first kernel launch, which computes the key again and raises."""
    start()
    thread = _thread
    if thread is not None:
        thread.join()
