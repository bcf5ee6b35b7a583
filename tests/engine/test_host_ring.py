"""engine/host_ring.py: every reader reads every frame in order, across processes and wraps; a
full ring holds the writer back and fails it with the readers behind named (at once when a
reader is gone); the file is unlinked while the mappings live on."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from mlaserve.engine.host_ring import HostRing, RingError

FRAME = 37


def frame(i: int) -> np.ndarray:
    return np.arange(i, i + FRAME, dtype=np.int64)


def test_frames_arrive_in_order_through_many_wraps() -> None:
    w = HostRing.create(readers=2, slots=3, frame_len=FRAME)
    r0 = HostRing.attach(w.path, 0, 2, 3, FRAME)
    r1 = HostRing.attach(w.path, 1, 2, 3, FRAME)
    w.unlink()
    assert not os.path.exists(w.path)  # gone by name, still mapped
    out = np.empty(FRAME, np.int64)
    for i in range(20):
        w.write(frame(i))
        if i % 2:  # reader 1 runs a frame behind reader 0, within the ring
            r1.read(out)
            assert (out == frame(i - 1)).all()
            r1.read(out)
            assert (out == frame(i)).all()
        r0.read(out)
        assert (out == frame(i)).all()
    assert w.count == r0.count == r1.count == 20
    for end in (w, r0, r1):
        end.close()


def test_a_full_ring_holds_the_writer_and_names_the_readers_behind() -> None:
    w = HostRing.create(readers=2, slots=2, frame_len=FRAME)
    r0 = HostRing.attach(w.path, 0, 2, 2, FRAME)
    w.unlink()
    out = np.empty(FRAME, np.int64)
    w.write(frame(0))
    w.write(frame(1))
    t0 = time.monotonic()
    with pytest.raises(RingError, match=r"readers \[0, 1\] stayed 2 frames behind"):
        w.write(frame(2), timeout_s=0.05)  # frame 0's slot: no reader has read it
    assert time.monotonic() - t0 >= 0.05
    with pytest.raises(RingError, match=r"a reader has gone \(readers \[1\] behind\)"):
        r0.read(out)  # reader 0 is done with frame 0's slot; reader 1 still holds it
        w.write(frame(2), timeout_s=60.0, alive=lambda: False)
    assert w.count == 2  # nothing was written over the held slot


def test_the_ends_keep_to_their_roles_and_sizes() -> None:
    w = HostRing.create(readers=1, slots=2, frame_len=FRAME)
    r = HostRing.attach(w.path, 0, 1, 2, FRAME)
    with pytest.raises(ValueError, match="expected"):
        HostRing.attach(w.path, 0, 1, 3, FRAME)
    with pytest.raises(ValueError, match="reader 1 of 1"):
        HostRing.attach(w.path, 1, 1, 2, FRAME)
    w.unlink()
    with pytest.raises(RingError, match="cannot write"):
        r.write(frame(0))
    with pytest.raises(RingError, match="cannot read"):
        w.read(np.empty(FRAME, np.int64))
    with pytest.raises(ValueError, match=r"int64 \[37\]"):
        w.write(np.zeros(FRAME, np.int32))


def _reader(path: str, index: int, n: int, conn) -> None:
    ring = HostRing.attach(path, index, 2, 4, FRAME, spin_s=0.01)
    out = np.empty(FRAME, np.int64)
    bad = 0
    for i in range(n):
        ring.read(out)
        bad += int(not (out == frame(i)).all())
    conn.send((ring.count, bad))


def test_two_reader_processes_read_every_frame_whole_and_in_order() -> None:
    """Across processes, with the writer as far ahead as the ring allows: no torn or skipped
    frame (each frame's words are its index onwards)."""
    n = 3000
    w = HostRing.create(readers=2, slots=4, frame_len=FRAME)
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for index in range(2):
        rx, tx = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_reader, args=(w.path, index, n, tx))
        proc.start()
        pipes.append(rx)
        procs.append(proc)
    try:
        for i in range(n):
            w.write(frame(i), timeout_s=60.0, alive=lambda: all(p.is_alive() for p in procs))
        results = [rx.recv() for rx in pipes]
    finally:
        w.unlink()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert results == [(n, 0), (n, 0)]
