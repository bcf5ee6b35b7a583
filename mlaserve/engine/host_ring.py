"""A ring of fixed-size int64 frames in shared memory: one writer, `readers` readers, every
reader reading every frame in order. How rank 0's step messages reach the tensor-parallel ranks
on its node (`engine/step_broadcast.py`): a frame costs the writer one copy and one store, where
a gloo broadcast costs it a socket round trip per peer (~0.25-0.3 ms a message at TP2 on an
H200 host, `bench/step_broadcast.py`). vLLM's workers take their inputs the same way.

    ring = HostRing.create(readers=3, slots=8, frame_len=2064)   # the writer; then ring.path
    ring = HostRing.attach(path, reader=r, ...)                  # reader r in [0, readers)
    ring.write(frame)    # writer: blocks only while the ring is full
    ring.read(out)       # reader: blocks until the next frame

The file (int64 words; each counter on its own 64-byte line, no false sharing):

    line 0          published: frames written so far (stored after the frame's words)
    line 1 + r      reader r's frames read (stored after it copied the frame out)
    slots           `slots` x `frame_len`: frame n lives in slot n % slots

Invariants (who owns a slot when): the writer writes frame n into its slot only once every
reader has read frame n - slots (each reader's count >= n - slots + 1), and publishes n + 1 only
after the frame's words; a reader copies frame n out only after it saw published > n, and
releases the slot (its count = n + 1) only after the copy. Counters only grow, each written by
one process. An aligned int64 store is atomic on x86-64 and aarch64; `_fence` (a lock's
acquire / release, a full barrier) orders the frame's words against the counters on machines
whose stores can be reordered.

Waiting: a reader spins for `spin_s` (a worker sitting between steps answers in microseconds;
each look gives up the GIL, so the process's other threads run), then polls with sleeps growing
to `MAX_SLEEP_S` (an idle engine costs no core). A reader waits
without a deadline (an idle engine is not a failure; a worker whose rank 0 died is ended by its
parent watch, `engine/tp_watchdog.py`). The writer waits for a full ring up to `timeout_s`, and
gives up at once when `alive()` says a reader has gone: `RingError` names the readers behind.

The creator unlinks the file once every reader has attached (`unlink`): the mappings outlive
the name, so nothing is left in /dev/shm whatever ends the processes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

__all__ = ["MAX_SLEEP_S", "HostRing", "RingError"]

LINE = 8  # int64 words per 64-byte cache line
MAX_SLEEP_S = 1e-3  # the longest sleep between two polls once a wait stops spinning
_FIRST_SLEEP_S = 2e-5
_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier: a lock's acquire and release (atomic read-modify-writes)."""
    _fence_lock.acquire()
    _fence_lock.release()


class RingError(RuntimeError):
    """The writer cannot go on: a reader has gone, or stayed a full ring behind past the timeout."""


def _shm_dir() -> str:
    return (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else tempfile.gettempdir()
    )


class HostRing:
    """One end of a ring (`create`: the writer's; `attach`: a reader's)."""

    def __init__(self, path: str, readers: int, slots: int, frame_len: int, reader: int | None,
                 mm: mmap.mmap, spin_s: float) -> None:  # fmt: skip
        self.path, self.readers, self.slots, self.frame_len = path, readers, slots, frame_len
        self.reader = reader  # None: the writer
        self.spin_s = spin_s
        self._mm = mm
        words = np.frombuffer(mm, dtype=np.int64)
        self._published = words[0:1]
        self._read = words[LINE : LINE * (1 + readers) : LINE]  # [readers]: each on its own line
        start = LINE * (1 + readers)
        self._slots = words[start : start + slots * frame_len].reshape(slots, frame_len)
        self.count = 0  # frames this end has written (writer) or read (reader)

    @staticmethod
    def nbytes(readers: int, slots: int, frame_len: int) -> int:
        return 8 * (LINE * (1 + readers) + slots * frame_len)

    @classmethod
    def create(cls, readers: int, slots: int, frame_len: int, spin_s: float = 0.0) -> HostRing:
        """The writer's end, in a new zeroed file (`path`) for readers to `attach`."""
        if readers < 1 or slots < 2 or frame_len < 1:
            raise ValueError(f"host ring: readers {readers}, slots {slots}, frame_len {frame_len}")
        fd, path = tempfile.mkstemp(prefix="mlaserve-step-ring-", dir=_shm_dir())
        size = cls.nbytes(readers, slots, frame_len)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, readers, slots, frame_len, None, mm, spin_s)

    @classmethod
    def attach(cls, path: str, reader: int, readers: int, slots: int, frame_len: int,
               spin_s: float = 0.0) -> HostRing:  # fmt: skip
        """Reader `reader`'s end of the ring `create` made at `path`."""
        if not 0 <= reader < readers:
            raise ValueError(f"host ring: reader {reader} of {readers}")
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != cls.nbytes(readers, slots, frame_len):
                raise ValueError(f"host ring {path}: {size} bytes, expected "
                                 f"{cls.nbytes(readers, slots, frame_len)}")  # fmt: skip
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, readers, slots, frame_len, reader, mm, spin_s)

    def unlink(self) -> None:
        """Remove the name (every reader attached): the mappings stay."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def write(self, frame: np.ndarray, timeout_s: float = 300.0,
              alive: Callable[[], bool] | None = None) -> None:  # fmt: skip
        """Frame `count` (int64 [frame_len]) into its slot, then publish it."""
        if self.reader is not None:
            raise RingError(f"host ring: reader {self.reader} cannot write")
        if frame.shape != (self.frame_len,) or frame.dtype != np.int64:
            raise ValueError(f"host ring: frame {frame.dtype} {frame.shape}, expected int64 "
                             f"[{self.frame_len}]")  # fmt: skip
        n = self.count
        need = n - self.slots + 1  # every reader has read frame n - slots
        if need > 0 and int(self._read.min()) < need:
            self._wait_free(need, timeout_s, alive)
        self._slots[n % self.slots] = frame
        _fence()
        self._published[0] = n + 1
        self.count = n + 1

    def _wait_free(self, need: int, timeout_s: float, alive: Callable[[], bool] | None) -> None:
        deadline = time.monotonic() + timeout_s
        sleep = _FIRST_SLEEP_S
        while int(self._read.min()) < need:
            behind = [r for r in range(self.readers) if int(self._read[r]) < need]
            if alive is not None and not alive():
                raise RingError(f"host ring: a reader has gone (readers {behind} behind)")
            if time.monotonic() > deadline:
                raise RingError(f"host ring: readers {behind} stayed {self.slots} frames behind "
                                f"for {timeout_s:g} s")  # fmt: skip
            time.sleep(sleep)
            sleep = min(2 * sleep, MAX_SLEEP_S)
        _fence()

    def read(self, out: np.ndarray) -> None:
        """The next frame into `out` (int64 [frame_len]); blocks until it is published."""
        if self.reader is None:
            raise RingError("host ring: the writer cannot read")
        n = self.count
        if int(self._published[0]) <= n:
            self._wait_published(n)
        _fence()
        out[:] = self._slots[n % self.slots]
        _fence()
        self._read[self.reader] = n + 1
        self.count = n + 1

    def _wait_published(self, n: int) -> None:
        published = self._published
        spin_until = time.monotonic() + self.spin_s
        while int(published[0]) <= n:  # spin: a step's message is usually under a millisecond away
            if time.monotonic() > spin_until:
                break
            time.sleep(0)  # lets this process's other threads take the GIL between two looks
        sleep = _FIRST_SLEEP_S
        while int(published[0]) <= n:
            time.sleep(sleep)
            sleep = min(2 * sleep, MAX_SLEEP_S)

    def close(self) -> None:
        del self._published, self._read, self._slots
        self._mm.close()
