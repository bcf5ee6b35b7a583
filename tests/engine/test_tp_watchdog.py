"""The tensor-parallel watchdogs (`engine/tp_watchdog.py`), with real processes on the CPU: a rank
0 stuck in a step after a worker died exits within the grace and leaves no worker; a worker whose
rank 0 died exits even while it sits in a wait that never ends; a step that fails by itself
leaves the watchdog quiet (the test process survives)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mlaserve.engine.tp_watchdog import STUCK_GRACE_S, StepWatch
from tests.service.server_process import pid_alive

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def test_step_watch_tracks_the_outermost_busy_stretch() -> None:
    watch = StepWatch()
    assert watch.stuck_since(0.0) is None
    with watch.busy():
        began = watch.began
        with watch.busy():  # nested: the stretch began at the outer entry
            assert watch.began == began and watch.depth == 2
        died_at = time.monotonic()
        assert 0.0 <= watch.stuck_since(died_at) < 1.0  # counted from the death, not before
        assert watch.stuck_since(began - 10.0) >= watch.stuck_since(died_at)
    assert watch.depth == 0 and watch.stuck_since(0.0) is None


def test_rank0_stuck_after_a_worker_died_exits_and_leaves_no_worker() -> None:
    # A step that never ends once rank 1 is killed: what a graphed collective does on a GPU.
    t0 = time.monotonic()
    done = _python(
        """
        import logging, os, signal, time
        logging.basicConfig(level=logging.INFO)
        from mlaserve import LLM
        llm = LLM(device="cpu", tensor_parallel_size=2)
        workers = llm.engine.tp_workers
        (pid,) = workers.pids
        print("worker", pid, flush=True)

        def stuck():
            os.kill(pid, signal.SIGKILL)
            time.sleep(120)

        workers.run_step(stuck)
        print("step returned", flush=True)
        """,
        timeout=240,
    )
    took = time.monotonic() - t0
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "step returned" not in done.stdout
    assert "stuck" in done.stderr and "exiting this process" in done.stderr, done.stderr[-3000:]
    pid = int(done.stdout.split("worker", 1)[1].split()[0])
    assert not pid_alive(pid)
    assert took < 120, f"exited after {took:.0f} s, not within the {STUCK_GRACE_S} s grace"


def test_worker_exits_when_its_parent_dies_even_inside_a_wait(tmp_path: Path) -> None:
    # The parent starts a child that watches it and then waits forever, and dies by SIGKILL.
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(
        """
        import multiprocessing as mp, os, signal, time

        def child():
            from mlaserve.engine.tp_watchdog import exit_with_parent
            exit_with_parent(poll_s=0.05)
            time.sleep(600)  # a collective whose peer is gone

        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=child)
            p.start()
            print(p.pid, flush=True)
            time.sleep(2.0)  # the child's thread is up
            os.kill(os.getpid(), signal.SIGKILL)
        """
    ))  # fmt: skip
    parent = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    child = int(parent.stdout.readline())
    parent.wait(timeout=60)
    deadline = time.monotonic() + 10.0
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = pid_alive(child)
    if alive:
        os.kill(child, 9)
    assert not alive, "the worker outlived its parent"
