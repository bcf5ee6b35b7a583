"""Bursts up to the admission bound (max_num_seqs + max_queue) are served; past it, 503 (issue 40).

`vllm bench serve` and similar clients open hundreds of requests at once. The tokenizer's queue
used to be 64 jobs whatever the admission bound, so a 512-request burst to a server started with
--max-queue 1024 got 434 `tokenizer_busy` refusals.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.service.server_process import ServerProcess, start_server

BURST = 512
IGNORE_EOS = {"ignore_eos": True}


def _client(server: ServerProcess) -> openai.AsyncOpenAI:
    # No connection cap on the client side: every request of the burst is on the wire at once.
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None), timeout=600)
    return openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, http_client=http
    )


@pytest.fixture()
def server_of(tmp_path):
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        proc = start_server(None, tmp_path / f"server{len(started)}.log", *args)  # default model
        started.append(proc)
        proc.wait_ready()
        return proc

    yield start
    for proc in started:
        assert proc.stop() == 0


def test_a_burst_within_the_bound_is_served(server_of) -> None:
    server = server_of("--max-queue", "1024", "--disable-log-requests")
    assert "tokenizer queue: 1088" in server.logs()  # 64 running + 1024 waiting

    async def burst() -> list[openai.types.Completion]:
        async with _client(server) as client:
            model = (await client.models.list()).data[0].id
            # Any refusal raises openai.APIStatusError.
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=model, prompt=f"request {i}:", max_tokens=2, extra_body=IGNORE_EOS
                    )
                    for i in range(BURST)
                )
            )

    results = asyncio.run(burst())
    assert len(results) == BURST
    assert all(r.usage.completion_tokens == 2 for r in results)


def test_past_the_bound_requests_get_503(server_of) -> None:
    # Bound 1 + 3 = 4. One sequence runs at a time and each generates hundreds of tokens, so the
    # admitted requests are all still in flight while the burst is decided.
    server = server_of("--max-num-seqs", "1", "--max-queue", "3", "--max-model-len", "512")
    bound, burst = 4, 12

    async def scenario() -> tuple[int, list[openai.APIStatusError]]:
        async with _client(server) as client:
            model = (await client.models.list()).data[0].id

            async def one() -> openai.AsyncStream | openai.APIStatusError:
                try:  # returns once the response has started: the request was admitted
                    return await client.completions.create(
                        model=model, prompt="Once upon a time", max_tokens=400, stream=True,
                        extra_body=IGNORE_EOS,
                    )  # fmt: skip
                except openai.APIStatusError as e:
                    return e

            results = await asyncio.gather(*(one() for _ in range(burst)))
            refused = [r for r in results if isinstance(r, openai.APIStatusError)]
            for r in results:
                if not isinstance(r, openai.APIStatusError):
                    await r.close()  # the client leaves: the server aborts the request
            return burst - len(refused), refused

    admitted, refused = asyncio.run(scenario())
    # Nothing within the bound is refused; a slot frees only when a 400-token request ends,
    # so the rest of the burst is refused (the queue full, or the tokenizer's queue of the
    # same size full while the first ones are encoded).
    assert admitted >= bound and refused, (admitted, refused)
    for e in refused:
        assert e.status_code == 503 and e.response.headers["retry-after"] == "1"
        assert e.body["code"] in ("queue_full", "tokenizer_busy"), e.body
