"""A speculative server end to end: streaming text equals non-streaming, the spec metrics
move, and `"return_spec_stats": true` adds draft/accept counts to `usage`."""

from __future__ import annotations

import json
import re

import pytest

from tests.service.server_process import start_server


@pytest.fixture(scope="module")
def spec_server(checkpoint, tmp_path_factory):
    proc = start_server(
        checkpoint("v3_mtp"),
        tmp_path_factory.mktemp("spec-server-logs") / "server.log",
        "--num-speculative-tokens", "2", "--page-size", "16", "--max-num-seqs", "8",
    )  # fmt: skip
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_speculative_server(spec_server) -> None:
    body = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    before = spec_server.get("/metrics").text
    plain = spec_server.post("/v1/completions", json=body).json()
    assert "spec_stats" not in plain["usage"]
    with_stats = spec_server.post(
        "/v1/completions", json={**body, "return_spec_stats": True}
    ).json()
    assert with_stats["choices"][0]["text"] == plain["choices"][0]["text"]
    stats = with_stats["usage"]["spec_stats"]
    assert stats["num_draft_tokens"] > 0 and stats["num_draft_tokens"] % 2 == 0
    assert 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]

    streamed = ""
    stream_body = {**body, "stream": True}
    with spec_server.http.stream("POST", "/v1/completions", json=stream_body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line.removeprefix("data: "))["choices"]
                streamed += choices[0]["text"] if choices else ""
    assert streamed == plain["choices"][0]["text"]

    after = spec_server.get("/metrics").text
    name = "mlaserve:spec_decode_num_drafts_total"
    assert _metric(after, name) > _metric(before, name)
    assert _metric(after, "mlaserve:spec_decode_accept_length_count") > 0
