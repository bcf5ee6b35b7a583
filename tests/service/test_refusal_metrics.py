"""`mlaserve:request_refused_total{reason}` on a live server: each refusal, whichever layer made
it (the API-key and body-size middlewares, validation, the route, admission), counted once by
its error code; answered requests and the probes' 503s are not refusals (issue 45)."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import openai
import pytest

from tests.service.server_process import STARTUP_TIMEOUT_S, ServerProcess, start_server

API_KEY = "refusals-key"
FAMILY = "mlaserve:request_refused_total"


def refused(server: ServerProcess) -> dict[str, float]:
    """reason -> count, from /metrics."""
    out = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(FAMILY + "{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def loading_refusals(model_dir, tmp_path_factory):
    """A server with an API key and room for two sequences (one running, one waiting); while it loads, /v1/models is
    asked until it answers, and the 503s it got on the way are tallied by code."""
    server = start_server(
        model_dir,
        tmp_path_factory.mktemp("refusals") / "server.log",
        "--max-num-seqs", "1", "--max-queue", "1", "--max-request-bytes", "4096",
        api_key=API_KEY,
    )  # fmt: skip
    seen: Counter[str] = Counter()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert time.monotonic() < deadline, server.logs()
            assert server.proc.poll() is None, server.logs()
            try:
                server.get("/health")  # the probes' 503s while loading are not refusals
                server.get("/ready")
                r = server.get("/v1/models")
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if r.status_code == 200:
                break
            assert r.status_code == 503, r.text
            seen[r.json()["error"]["code"]] += 1
            time.sleep(0.05)
        yield server, seen
    finally:
        server.stop()


def test_each_refusal_is_counted_once_by_reason(loading_refusals) -> None:
    server, during_load = loading_refusals
    assert set(during_load) <= {"not_ready"}
    assert refused(server) == {k: float(v) for k, v in during_load.items()}

    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    model = good.models.list().data[0].id
    assert good.completions.create(model=model, prompt="hi", max_tokens=2).usage  # not refused
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # 401, from the API-key middleware
        bad_key.completions.create(model=model, prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):  # 400, from the request's validation
        good.completions.create(model=model, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):  # 400, an unsupported field
        good.completions.create(model=model, prompt="hi", max_tokens=1, suffix="!")
    with pytest.raises(openai.NotFoundError):  # 404, from the route
        good.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    too_big = server.post("/v1/completions", content=b'{"prompt": "' + b"x" * 8192 + b'"}')
    assert too_big.status_code == 413  # from the body-size middleware
    unknown = server.get("/v1/no-such-route")
    assert unknown.status_code == 404

    # A stream holds every slot: the next request is refused at admission. The held one may
    # finish first on a fast machine (then that try is answered 200, and not counted).
    held_body = {
        "model": model, "prompt": "hi", "max_tokens": 240, "ignore_eos": True, "n": 2,
        "stream": True,
    }  # fmt: skip
    admission: Counter[int] = Counter()
    while admission[503] == 0 and admission[200] < 5:
        with server.http.stream("POST", "/v1/completions", json=held_body) as held:
            assert held.status_code == 200
            lines = held.iter_lines()  # kept: closing the iterator would close the stream
            assert next(lines).startswith("data: ")
            late = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        admission[late.status_code] += 1
        if late.status_code == 503:
            assert late.json()["error"]["code"] == "queue_full"
    assert admission[503] == 1, admission

    expected = Counter(during_load) + Counter(
        invalid_api_key=1, invalid_value=1, unsupported_parameter=1, model_not_found=1,
        request_too_large=1, not_found=1, queue_full=1,
    )  # fmt: skip
    assert refused(server) == {k: float(v) for k, v in expected.items()}
    assert server.get("/health").status_code == 200  # still serving
