"""Watchdogs that end a tensor-parallel group when one of its processes dies while another waits
on the device for it.

A collective replayed from a CUDA graph (NCCL's, or the custom all-reduce spinning on its signal
pads) waits for its peers without a deadline: torch's NCCL watchdog does not see graph replays,
and a host thread waiting on the step's event never returns. Nothing can cancel such a wait, so
the process has to go:

- rank 0, `StepWatch` + `watch_workers`: a thread waits for any worker to exit, or for another
  node to fall silent (`GroupLoss`, reported by `engine/tp_heartbeat.py`). From then on, if
  rank 0 is busy (in a step, loading or warming up) and that busy stretch does not end within
  `STUCK_GRACE_S` of the death, it is stuck in a collective with the dead rank: the thread kills
  the other workers and exits the process with code 1. Under `mlaserve serve` that process is
  the engine's: the frontend sees it die, fails the open requests with `engine_dead` and /health
  turns 503. A busy stretch that ends (gloo on the CPU, an eager NCCL collective that errors)
  lets the step raise `EngineDeadError` as usual, and a stopped group stands the thread down.
- a worker, `exit_with_parent`: a thread polls its parent; once rank 0 is gone (killed from
  outside, or exited as above) the worker exits at once, even from inside a collective.

Cost on the step path: `StepWatch.busy` is two attribute writes and a clock read per step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

__all__ = [
    "PARENT_POLL_S",
    "STUCK_GRACE_S",
    "GroupLoss",
    "StepWatch",
    "exit_with_parent",
    "watch_workers",
]

logger = logging.getLogger(__name__)

# A step, load or warm-up still running this long after a worker died waits for that worker
# on the device (a healthy bs-256 decode or a long prefill chunk is well under a second).
STUCK_GRACE_S = 5.0
PARENT_POLL_S = 0.5  # how often a worker looks for its parent
_POLL_S = 0.1  # how often rank 0's watchdog looks at the busy state after a death


class StepWatch:
    """Rank 0's busy state, written by the thread that runs steps and read by the watchdog.
    Invariant: `depth` > 0 exactly while that thread is inside `busy()`; `began` is when the
    outermost `busy()` was entered (time.monotonic())."""

    def __init__(self) -> None:
        self.depth = 0
        self.began = 0.0

    def busy(self) -> StepWatch:
        """`with watch.busy():` marks the block busy (a plain context manager: it wraps steps)."""
        return self

    def __enter__(self) -> None:
        if self.depth == 0:
            self.began = time.monotonic()
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1

    def stuck_since(self, died_at: float) -> float | None:
        """Seconds the current busy stretch has run since `died_at`, or None when idle."""
        if self.depth == 0:
            return None
        return time.monotonic() - max(died_at, self.began)


class GroupLoss:
    """The first death the group saw: a local worker that exited (`watch_workers`) or a node that
    went silent (`engine/tp_heartbeat.py`). Set once; read by the watchdog and by
    `TPWorkers.check` (the next step raises)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.why: str | None = None
        self.at = 0.0  # time.monotonic() of the report

    def report(self, why: str) -> None:
        with self._lock:
            if self.why is None:
                self.why, self.at = why, time.monotonic()
                self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


def watch_workers(
    procs: list[Any],
    watch: StepWatch,
    stopped: Callable[[], bool],
    grace_s: float = STUCK_GRACE_S,
    loss: GroupLoss | None = None,
) -> threading.Thread:
    """Start rank 0's watchdog over `procs` (multiprocessing.Process, this node's ranks 1..) and
    whatever else reports to `loss` (a remote node's silence). `stopped()` is True once the group
    was stopped on purpose (a normal stop, or `failed`): the thread ends."""
    loss = GroupLoss() if loss is None else loss
    if procs:
        threading.Thread(
            target=_wait_for_exit, args=(procs, loss), name="mlaserve-tp-exits", daemon=True
        ).start()
    thread = threading.Thread(
        target=_watch, args=(procs, watch, stopped, grace_s, loss), name="mlaserve-tp-watchdog",
        daemon=True,
    )  # fmt: skip
    thread.start()
    return thread


def _wait_for_exit(procs: list[Any], loss: GroupLoss) -> None:
    wait([p.sentinel for p in procs])  # returns once any worker has exited
    dead = [(rank, p.exitcode) for rank, p in enumerate(procs, 1) if not p.is_alive()]
    loss.report(f"rank(s) {[r for r, _ in dead]} exited (code {[c for _, c in dead]})")


def _watch(
    procs: list[Any], watch: StepWatch, stopped: Callable[[], bool], grace_s: float, loss: GroupLoss
) -> None:
    while not loss.wait(1.0):
        if stopped():
            return
    while not stopped():
        running = watch.stuck_since(loss.at)
        if running is not None and running >= grace_s:
            logger.error(
                "tensor parallel: %s and rank 0 has been stuck %.1f s since in a step: its "
                "collectives wait on the device for the dead rank, which nothing can cancel. "
                "Killing the other workers and exiting this process.", loss.why, running,
            )  # fmt: skip
            for p in procs:
                if p.is_alive():
                    p.kill()
            for handler in logging.getLogger().handlers:
                with contextlib.suppress(Exception):
                    handler.flush()
            sys.stderr.flush()
            os._exit(1)
        time.sleep(_POLL_S)


def exit_with_parent(poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Start a worker's thread that exits the process once its parent (rank 0) is gone."""
    parent = os.getppid()

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)  # rank 0 is gone: a collective this rank sits in will never complete

    thread = threading.Thread(target=poll, name="mlaserve-tp-parent", daemon=True)
    thread.start()
    return thread
