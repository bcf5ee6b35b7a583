"""The engine process and its frontend, driven in this process through the app (ASGI), with
the real engine on the tiny checkpoint.

A fault is injected into a real `LLMEngine` in the engine process (its `step` raises once armed
after warm-up), or the engine process is killed, to see what the service does when the engine
dies.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from mlaserve.config import EngineConfig
from mlaserve.llm_engine import LLMEngine
from mlaserve.service.app import build_app
from mlaserve.service.async_engine import AsyncEngine, EngineState

BODY = {"prompt": "Once upon a time", "max_tokens": 50, "ignore_eos": True}


def _failing_engine(fail_after_steps: int, config: EngineConfig) -> LLMEngine:
    """A real engine whose step() raises after `fail_after_steps` steps past warm-up. Runs in the
    engine process (module level, so that `functools.partial` of it pickles)."""
    engine = LLMEngine(config)
    real_step, real_warmup = engine.step, engine.warmup
    state = {"armed": False, "steps": 0}

    def warmup() -> None:
        real_warmup()
        state["armed"] = True

    def step():
        if state["armed"]:
            state["steps"] += 1
            if state["steps"] > fail_after_steps:
                raise RuntimeError("injected fault: the accelerator fell off the bus")
        return real_step()

    engine.warmup, engine.step = warmup, step
    return engine


def _failing_engine_factory(fail_after_steps: int):
    return functools.partial(_failing_engine, fail_after_steps)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _started(engine: AsyncEngine, timeout: float = 60.0) -> None:
    engine.start()
    deadline = time.monotonic() + timeout
    while not engine.is_ready:
        assert engine.state is not EngineState.DEAD, engine.error
        assert time.monotonic() < deadline, "engine not ready in time"
        await asyncio.sleep(0.02)


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", page_size=16)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_death_fails_in_flight_requests_and_health(model_dir, stream) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(
            _config(model_dir), max_queue=4, engine_factory=_failing_engine_factory(5)
        )
        app = build_app(engine)
        await _started(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            response = await client.post("/v1/completions", json={**BODY, "stream": stream})
            if stream:
                assert response.status_code == 200  # the stream had started
                frames = [f for f in response.text.split("\n\n") if f]
                assert frames[-1] == "data: [DONE]"
                error = json.loads(frames[-2].removeprefix("data: "))["error"]
            else:
                assert response.status_code == 500
                error = response.json()["error"]
            assert error["code"] == "engine_dead" and "injected fault" in error["message"]
            assert engine.state is EngineState.DEAD
            health = await client.get("/health")
            assert health.status_code == 503 and "injected fault" in health.json()["error"]
            assert (await client.get("/ready")).status_code == 503
            again = await client.post("/v1/completions", json=BODY)
            assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
            assert (await client.get("/metrics")).status_code == 200
        await engine.shutdown()

    asyncio.run(scenario())


def test_idle_engine_process_does_not_spin_and_stops_cleanly(model_dir) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(_config(model_dir), max_queue=4)
        app = build_app(engine)
        await _started(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            ok = await client.post("/v1/completions", json={**BODY, "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        pid = engine.pid
        assert pid is not None and pid != os.getpid()
        cpu0, own0 = _cpu_seconds(pid), time.process_time()
        await asyncio.sleep(1.0)
        assert _cpu_seconds(pid) - cpu0 < 0.25  # blocked on its queue, not polling
        assert time.process_time() - own0 < 0.25  # nor is the frontend
        await engine.shutdown()
        assert engine.state is EngineState.STOPPED and not engine.is_alive
        assert not Path(f"/proc/{pid}").exists()  # exited and reaped

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_killed_engine_process_fails_in_flight_requests(model_dir, stream) -> None:
    """A dead child (OOM killer, segfault in a kernel) is noticed: its pipe reaches EOF."""
    fatal: list[BaseException] = []

    async def scenario() -> None:
        engine = AsyncEngine(_config(model_dir), max_queue=4, on_fatal=fatal.append)
        app = build_app(engine)
        await _started(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {**BODY, "max_tokens": 200, "stream": stream}
            request = asyncio.ensure_future(client.post("/v1/completions", json=body))
            while not engine._streams or engine._adds:  # admitted by the engine
                await asyncio.sleep(0.005)
            assert engine.pid is not None
            os.kill(engine.pid, signal.SIGKILL)
            response = await request
            if stream:
                assert response.status_code == 200
                frames = [f for f in response.text.split("\n\n") if f]
                assert frames[-1] == "data: [DONE]"
                error = json.loads(frames[-2].removeprefix("data: "))["error"]
            else:
                assert response.status_code == 500
                error = response.json()["error"]
            assert error["code"] == "engine_dead" and "SIGKILL" in error["message"]
            assert engine.state is EngineState.DEAD
            assert (await client.get("/health")).status_code == 503
        await engine.shutdown()

    asyncio.run(scenario())
    assert len(fatal) == 1 and "SIGKILL" in str(fatal[0])

    asyncio.run(scenario())
