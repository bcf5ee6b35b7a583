"""Prefix caching through a real server and the official `openai` client: usage's cached_tokens
(completions, chat, streaming), the Prometheus counters, cache_salt isolation and its 400, and
POST /reset_prefix_cache behind the API key."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.service.server_process import ServerProcess, start_server

KEY = "pc-key"
GREEDY = {"temperature": 0.0, "max_tokens": 4}


@pytest.fixture(scope="module")
def pc_server(model_dir, tmp_path_factory: pytest.TempPathFactory):
    proc = start_server(
        model_dir,
        tmp_path_factory.mktemp("pc-logs") / "server.log",
        "--enable-prefix-caching", "--page-size", "4", "--max-num-seqs", "8",
        api_key=KEY,
    )  # fmt: skip
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture()
def client(pc_server: ServerProcess):
    c = openai.OpenAI(base_url=f"{pc_server.url}/v1", api_key=KEY, max_retries=0)
    yield c
    c.close()


def prompt(seed: int, n: int = 21) -> list[int]:
    return [(seed * 31 + i * 7) % 200 + 5 for i in range(n)]


def model(client) -> str:
    return client.models.list().data[0].id


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_completions_report_cached_tokens(client, pc_server) -> None:
    m, p = model(client), prompt(1)
    first = client.completions.create(model=m, prompt=p, **GREEDY)
    assert cached(first.usage) == 0
    second = client.completions.create(model=m, prompt=p, **GREEDY)
    assert cached(second.usage) == 20  # 5 full pages of 4; the 21st token is computed
    assert second.choices[0].text == first.choices[0].text
    # Streaming, usage in the last chunk.
    chunks = list(
        client.completions.create(
            model=m, prompt=p, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert cached(chunks[-1].usage) == 20
    assert pc_server.metric("mlaserve:prefix_cache_hits_total") >= 40
    assert pc_server.metric("mlaserve:prefix_cache_queries_total") >= 3 * 21


def test_chat_reports_cached_tokens(client) -> None:
    m = model(client)
    messages = [{"role": "system", "content": "You answer in one word. " * 4},
                {"role": "user", "content": "Colour of the sky?"}]  # fmt: skip
    client.chat.completions.create(model=m, messages=messages, **GREEDY)
    again = client.chat.completions.create(model=m, messages=messages, **GREEDY)
    assert cached(again.usage) >= 4 and cached(again.usage) < again.usage.prompt_tokens
    chunks = list(
        client.chat.completions.create(
            model=m, messages=messages, stream=True, stream_options={"include_usage": True},
            **GREEDY,
        )
    )  # fmt: skip
    assert cached(chunks[-1].usage) == cached(again.usage)


def test_cache_salt_isolates_tenants(client) -> None:
    m, p = model(client), prompt(2)

    def run(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        return cached(
            client.completions.create(model=m, prompt=p, extra_body=extra, **GREEDY).usage
        )

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0  # same prompt, another salt: no hit
    assert run(None) == 0
    assert run("tenant-a") == 20
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=m, prompt=p, extra_body={"cache_salt": 5}, **GREEDY)
    assert "cache_salt" in str(err.value)


def test_reset_prefix_cache_needs_the_key_and_forgets(client, pc_server) -> None:
    m, p = model(client), prompt(3)
    client.completions.create(model=m, prompt=p, **GREEDY)
    assert cached(client.completions.create(model=m, prompt=p, **GREEDY).usage) == 20
    assert httpx.post(f"{pc_server.url}/reset_prefix_cache").status_code == 401
    r = pc_server.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["num_freed_pages"] > 0
    assert cached(client.completions.create(model=m, prompt=p, **GREEDY).usage) == 0


def test_cache_off_has_no_details(model_dir, tmp_path_factory: pytest.TempPathFactory) -> None:
    """--no-enable-prefix-caching (vLLM's flag; the cache is on by default): no details, and a
    reset frees nothing."""
    proc = start_server(
        model_dir, tmp_path_factory.mktemp("pc-off-logs") / "server.log",
        "--no-enable-prefix-caching", "--page-size", "4",
    )  # fmt: skip
    try:
        proc.wait_ready()
        with openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0) as c:
            for _ in range(2):  # the second would hit with the cache on
                out = c.completions.create(model=model(c), prompt=prompt(4), **GREEDY)
                assert out.usage.prompt_tokens_details is None
        r = proc.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json()["num_freed_pages"] == 0
    finally:
        proc.stop()
