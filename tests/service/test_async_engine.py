"""The engine thread and its bridge, in process with the real engine on the tiny checkpoint.

A fault is injected into a real `LLMEngine` (its `step` raises once armed after warm-up) to see
what the service does when the engine thread dies.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from mlaserve.config import EngineConfig
from mlaserve.llm_engine import LLMEngine
from mlaserve.service.app import build_app
from mlaserve.service.async_engine import AsyncEngine, EngineState

BODY = {"prompt": "Once upon a time", "max_tokens": 50, "ignore_eos": True}


def _failing_engine_factory(fail_after_steps: int):
    """Build a real engine whose step() raises after `fail_after_steps` steps past warm-up."""

    def factory(config: EngineConfig) -> LLMEngine:
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

    return factory


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


def test_idle_engine_thread_does_not_spin_and_stops_cleanly(model_dir) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(_config(model_dir), max_queue=4)
        app = build_app(engine)
        await _started(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            ok = await client.post("/v1/completions", json={**BODY, "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        cpu0 = time.process_time()
        await asyncio.sleep(1.0)
        assert time.process_time() - cpu0 < 0.25  # blocked on its queue, not polling
        await engine.shutdown()
        assert engine.state is EngineState.STOPPED and not engine.is_alive

    asyncio.run(scenario())
