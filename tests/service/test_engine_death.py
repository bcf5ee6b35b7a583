"""A dead engine is visible and the server goes down so that it is restarted (issue 40, item 5).

The contract (docs/api.md, the paragraph before "Endpoints"): once the engine process dies, the
server notices at once (its pipe's EOF wakes the event loop), /health answers 503 from then on,
every open response ends with `engine_dead`, and the process exits 1 as soon as those responses
are out, killing rather than waiting for an engine process that failed and hangs. A probe
therefore sees 503 or a refused connection, never 200 again.

tests/service/test_hardening.py has the step that raises (and the server that exits 1);
tests/service/test_async_engine.py the same through the app in-process. These add a SIGKILLed
engine under a real server, an engine that fails and then hangs instead of exiting, and a dead
command thread in the engine process.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx

from mlaserve.config import EngineConfig
from mlaserve.service.async_engine import AsyncEngine, EngineState
from tests.service.server_failure import EXIT_WAIT_S, HealthPoller, stream_until_error
from tests.service.server_process import REPO_ROOT, ServerProcess, free_port, start_server


def _engine_pid(server: ServerProcess) -> int:
    match = re.search(r"engine process started \(pid (\d+)\)", server.logs())
    assert match, server.logs()
    return int(match.group(1))


def test_killed_engine_turns_health_503_ends_the_stream_and_exits_1(tmp_path) -> None:
    server = start_server(None, tmp_path / "server.log")  # the default model
    try:
        server.wait_ready()
        pid = _engine_pid(server)
        assert server.get("/health").json() == {"status": "ok"}
        poller = HealthPoller(server.url)
        error = stream_until_error(server, lambda: (poller.start(), os.kill(pid, signal.SIGKILL)))
        assert error["code"] == "engine_dead" and "SIGKILL" in error["message"], error
        # The engine was dead before this error was sent: from here on, never 200 again.
        try:
            after = httpx.get(f"{server.url}/health", timeout=5.0)
            assert after.status_code == 503 and after.json()["status"] == "dead", after.text
        except httpx.TransportError:
            pass  # the server already stopped listening on its way out
        assert server.proc.wait(EXIT_WAIT_S) == 1
        poller.stop.set()
        poller.join()
        codes = poller.codes_never_up_again()
        assert all("SIGKILL" in b["error"] or "not running" in b["error"]
                   for c, b in poller.seen if c == 503), poller.seen  # fmt: skip
        print(f"/health after the kill: {codes.count(200)} x 200, {codes.count(503)} x 503, "
              "then refused")  # fmt: skip
        logs = server.logs()
        assert "the engine died: RuntimeError('the engine process was killed by SIGKILL')" in logs
        assert "exit code 1" in logs
    finally:
        server.stop(signal.SIGKILL)


# Runs at import, in the server and (re-imported by `spawn` as `__mp_main__`) in the engine
# process: a step fault, after which the engine process hangs instead of exiting, as one stuck
# on a faulted device may.
_FAILING_THEN_HANGING_SERVER = """
import os, sys, time
import mlaserve.service.engine_core as core
from mlaserve.llm_engine import LLMEngine
from mlaserve.service.cli import main

real_step, steps = LLMEngine.step, 0

def step(self):
    global steps
    if "__warmup__" not in self.requests:
        steps += 1
        if steps > 20:
            raise RuntimeError("injected device-side assert")
    return real_step(self)

class HangingOS:  # engine_core's `os`, whose _exit never returns
    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def _exit(code):
        time.sleep(3600)

LLMEngine.step = step
core.os = HangingOS()
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


def test_an_engine_that_fails_and_hangs_is_killed_and_the_server_exits_1(tmp_path) -> None:
    script = tmp_path / "failing_server.py"
    script.write_text(_FAILING_THEN_HANGING_SERVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLASERVE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    port, log_path = free_port(), tmp_path / "server.log"
    # A shutdown timeout far beyond the exit wait: waiting for the hung engine would show.
    cmd = [sys.executable, str(script), "serve", "--port", str(port), "--device", "cpu",
           "--shutdown-timeout", "600"]  # fmt: skip
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(popen, port, log_path, None)
    try:
        server.wait_ready()
        pid = _engine_pid(server)
        error = stream_until_error(server, lambda: None)
        assert error["code"] == "engine_dead", error
        assert "injected device-side assert" in error["message"], error
        assert popen.wait(EXIT_WAIT_S) == 1
        assert not os.path.exists(f"/proc/{pid}")  # killed and reaped, not left hanging
        assert "exit code 1" in server.logs()
    finally:
        server.stop(signal.SIGKILL)


def test_a_dead_command_thread_fails_the_engine(model_dir) -> None:
    """The engine process's command thread dies on a command it cannot read: the loop would
    wait for commands forever, so it fails instead (FAILED, exit 1)."""
    fatal: list[BaseException] = []

    async def scenario() -> None:
        config = EngineConfig(model=str(model_dir), device="cpu", page_size=16)
        engine = AsyncEngine(config, max_queue=4, on_fatal=fatal.append)
        engine.start()
        deadline = time.monotonic() + 120  # bounds a hang (start-up takes seconds)
        while not engine.is_ready:
            assert engine.state is not EngineState.DEAD, engine.error
            assert time.monotonic() < deadline, "the engine did not start"
            await asyncio.sleep(0.02)
        assert engine._process is not None and engine._process.commands is not None
        proc = engine._process.proc
        engine._process.commands.send_bytes(b"not a pickle")
        deadline = time.monotonic() + EXIT_WAIT_S  # was: the loop waited for commands forever
        while engine.state is not EngineState.DEAD:
            assert time.monotonic() < deadline, "the engine did not fail"
            await asyncio.sleep(0.02)
        await asyncio.to_thread(proc.join, EXIT_WAIT_S)
        assert proc.exitcode == 1
        await engine.shutdown()

    asyncio.run(scenario())
    assert len(fatal) == 1 and "command thread failed" in str(fatal[0]), fatal
