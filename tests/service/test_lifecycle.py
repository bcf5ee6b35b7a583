"""Request lifecycle against real servers: probes, API key, disconnects, back-pressure, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from contextlib import AsyncExitStack

import httpx
import openai
import pytest

from tests.service.server_process import ServerProcess, start_server

API_KEY = "test-key-3f9a"
LONG = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
# 16 x 240 tokens: seconds of work on 2 CPU cores, so the client surely leaves before the end.
VERY_LONG = {**LONG, "max_tokens": 240, "n": 16}


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _idle(server: ServerProcess) -> bool:
    return (
        server.metric("mlaserve:num_requests_running") == 0
        and server.metric("mlaserve:num_requests_waiting") == 0
        and server.metric("mlaserve:kv_cache_usage_perc") == 0
    )


# ----- disconnects (shared server) -----
def test_client_dropping_a_stream_aborts_it_and_frees_its_pages(server) -> None:
    aborted = server.metric("mlaserve:request_success_total", finished_reason="abort")
    lengths = server.metric("mlaserve:request_success_total", finished_reason="length")
    with (
        httpx.Client(base_url=server.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json={**VERY_LONG, "stream": True}) as response,
    ):
        assert response.status_code == 200
        # NOTE: keep a reference to the iterator: a dropped one is closed, and with it the
        # connection, which would abort the request before the checks below.
        lines, frames = response.iter_lines(), []
        for line in lines:
            if line.startswith("data: "):
                frames.append(line)
            if len(frames) == 3:
                break
        assert not _idle(server), server.get("/metrics").text
        # Leaving the block closes the connection mid-stream.
    assert _wait_until(lambda: _idle(server), timeout=3.0), server.get("/metrics").text
    assert server.metric("mlaserve:request_success_total", finished_reason="abort") == aborted + 16
    assert server.metric("mlaserve:request_success_total", finished_reason="length") == lengths


def test_client_timing_out_a_plain_request_aborts_it(server) -> None:
    aborted = server.metric("mlaserve:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions", json=VERY_LONG, timeout=httpx.Timeout(30, read=0.5)
        )
    assert _wait_until(lambda: _idle(server), timeout=3.0), server.get("/metrics").text
    assert server.metric("mlaserve:request_success_total", finished_reason="abort") == aborted + 16


# Runs in the server and (re-imported by `spawn`) in the engine process: a warm-up that takes
# 2 s longer, so the probe test sees /ready's 503 however fast this machine loads the model.
_SLOW_WARMUP_SERVER = """
import sys, time
from mlaserve.llm_engine import LLMEngine
from mlaserve.service.cli import main

real_warmup = LLMEngine.warmup

def warmup(self):
    time.sleep(2.0)
    return real_warmup(self)

LLMEngine.warmup = warmup
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


# ----- a small server with an API key: 2 running + 1 waiting at most -----
@pytest.fixture(scope="module")
def small_server(model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("small-server")
    script = workdir / "slow_warmup_server.py"
    script.write_text(_SLOW_WARMUP_SERVER)
    proc = start_server(
        model_dir,
        workdir / "server.log",
        "--max-num-seqs", "2", "--max-queue", "1", "--shutdown-timeout", "30",
        api_key=API_KEY,
        script=script,
    )  # fmt: skip
    try:
        proc.startup = proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_health_is_200_and_ready_503_until_warm(small_server) -> None:
    seen = small_server.startup
    assert all(health == 200 for health, _ in seen), seen
    assert seen[-1] == (200, 200)
    assert (200, 503) in seen, "expected /ready to answer 503 while the model loads"
    log = small_server.logs()
    for step in ("effective configuration", "loading weights", "warm-up done", "ready: serving"):
        assert step in log
    assert "api_key = '***'" in log and API_KEY not in log


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": f"Bearer {API_KEY}x"}, 401),
        ({"Authorization": f"Basic {API_KEY}"}, 401),
        ({"Authorization": API_KEY}, 401),
        ({"Authorization": f"Bearer {API_KEY}"}, 200),
        ({"Authorization": f"bearer {API_KEY}"}, 200),
    ],
)
@pytest.mark.parametrize("path", ["/v1/models", "/version", "/openapi.json"])
def test_api_key(small_server, path, headers, status) -> None:
    response = httpx.get(f"{small_server.url}{path}", headers=headers)
    assert response.status_code == status
    if status == 401:
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"


def test_api_key_on_generation_and_exempt_routes(small_server) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{small_server.url}{path}").status_code == 200
    bad = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="x", prompt="hi", max_tokens=1)
    # Refused before the body is even read: a malformed one is still a 401.
    response = httpx.post(f"{small_server.url}/v1/completions", content=b"{oops")
    assert response.status_code == 401
    good = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key=API_KEY, max_retries=0)
    model = good.models.list().data[0].id
    assert good.completions.create(model=model, prompt="hi", max_tokens=2).usage.total_tokens > 0


def test_full_queue_answers_503_with_retry_after(small_server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def scenario() -> httpx.Response:
        async with AsyncExitStack() as stack:
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=small_server.url, headers=headers, timeout=60)
            )
            for _ in range(3):  # 2 running + 1 waiting: the server is full
                response = await stack.enter_async_context(
                    client.stream("POST", "/v1/completions", json={**LONG, "stream": True})
                )
                assert response.status_code == 200
            return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})

    response = asyncio.run(scenario())
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "queue_full"
    assert _wait_until(lambda: _idle(small_server), timeout=5.0)
    ok = small_server.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers
    )
    assert ok.status_code == 200


def test_sigterm_finishes_in_flight_requests_and_exits_0(small_server) -> None:
    """Runs last in this module: it stops the server."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {**LONG, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
    with (
        httpx.Client(base_url=small_server.url, headers=headers, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        small_server.proc.send_signal(signal.SIGTERM)
        # No new work is admitted: the port closes, or a request that slips in gets a 503.
        try:
            late = httpx.post(
                f"{small_server.url}/v1/completions", json={"prompt": "hi"}, headers=headers
            )
            assert late.status_code == 503, late.text
        except httpx.TransportError:
            pass
        rest = [line for line in lines if line.startswith("data: ")]
    frames = [first, *rest]
    assert frames[-1] == "data: [DONE]"
    assert '"completion_tokens":40' in frames[-2]  # the request ran to the end
    assert small_server.proc.wait(30) == 0
    assert "exit code 0" in small_server.logs()


def test_sigterm_ends_what_outlives_the_shutdown_timeout_cleanly(model_dir, tmp_path) -> None:
    """Issue 13: past the drain timeout, an open stream ends with an error event
    (`server_shutdown`) and `[DONE]` (was: cut mid-body), a waiting non-streaming request gets
    a 503 body, and the process exits 0."""
    # One sequence at a time: the 16 choices of 240 tokens then run one after another (thousands
    # of steps), so the stream outlives the 1 s timeout however fast the machine is.
    proc = start_server(
        model_dir, tmp_path / "server.log", "--shutdown-timeout", "1", "--max-num-seqs", "1"
    )
    try:
        proc.wait_ready()
        body = {**VERY_LONG, "stream": True}

        async def plain_request() -> httpx.Response:
            async with httpx.AsyncClient(base_url=proc.url, timeout=60) as client:
                return await client.post("/v1/completions", json={**LONG, "max_tokens": 100})

        async def scenario() -> tuple[list[str], httpx.Response]:
            async with (
                httpx.AsyncClient(base_url=proc.url, timeout=60) as client,
                client.stream("POST", "/v1/completions", json=body) as response,
            ):
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                waiting = asyncio.ensure_future(plain_request())  # queued behind the stream
                await asyncio.sleep(0.5)
                proc.proc.send_signal(signal.SIGTERM)
                frames = [line async for line in lines if line.startswith("data: ")]
                return frames, await waiting

        t0 = time.monotonic()
        frames, plain = asyncio.run(scenario())
        assert frames[-1] == "data: [DONE]"
        error = json.loads(frames[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutdown" and "shutdown timeout" in error["message"]
        assert plain.status_code == 503, plain.text
        assert plain.json()["error"]["code"] == "server_shutdown"
        assert proc.proc.wait(30) == 0
        assert time.monotonic() - t0 < 10
    finally:
        proc.stop()
