"""The engine process against real servers: it never outlives the server, however the server
ends (SIGTERM drain, SIGKILL), and it is not the one that answers a Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from tests.service.server_process import ServerProcess, start_server

BODY = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}


def _engine_pid(proc: ServerProcess) -> int:
    match = re.search(r"engine process started \(pid (\d+)\)", proc.logs())
    assert match, proc.logs()
    pid = int(match.group(1))
    assert pid != proc.proc.pid
    return pid


def _exists(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _exists(pid):
            return True
        time.sleep(0.05)
    return False


def test_engine_process_stops_with_the_server(model_dir, tmp_path) -> None:
    proc = start_server(model_dir, tmp_path / "server.log", "--page-size", "16")
    try:
        proc.wait_ready()
        pid = _engine_pid(proc)
        assert _exists(pid)
        assert proc.post("/v1/completions", json=BODY).status_code == 200
        # A Ctrl-C reaches the whole process group; the engine process ignores it, so the
        # server still drains and serves (here: nothing to drain, it exits 0).
        os.kill(pid, signal.SIGINT)
        assert proc.post("/v1/completions", json=BODY).status_code == 200
    finally:
        code = proc.stop()
    assert code == 0, proc.logs()
    assert _wait_gone(pid, timeout=5.0)


def test_engine_process_exits_when_the_server_is_killed(model_dir, tmp_path) -> None:
    proc = start_server(model_dir, tmp_path / "server.log", "--page-size", "16")
    try:
        proc.wait_ready()
        pid = _engine_pid(proc)
        assert proc.post("/v1/completions", json=BODY).status_code == 200
    finally:
        proc.stop(signal.SIGKILL)  # no exit hook, no lifespan: only the pipe's EOF tells it
    assert _wait_gone(pid), f"engine process {pid} outlived the killed server"
    if _exists(pid):  # pragma: no cover - clean up after a failure
        os.kill(pid, signal.SIGKILL)
