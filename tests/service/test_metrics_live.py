"""Metrics of a live server after real traffic: queue time ends when a request is first
scheduled (so it is below its TTFT), and vLLM's per-request and per-step families move."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.service.server_process import ServerProcess, start_server

NEW_FAMILIES = (
    "mlaserve:request_prefill_time_seconds_count",
    "mlaserve:request_decode_time_seconds_count",
    "mlaserve:request_prompt_tokens_count",
    "mlaserve:request_generation_tokens_count",
    "mlaserve:iteration_tokens_total_count",
)


def scrape(server: ServerProcess) -> dict[str, float]:
    """Unlabelled view (model_name dropped) of every sample without other labels."""
    out: dict[str, float] = {}
    for line in server.get("/metrics").text.splitlines():
        m = re.match(r'^([\w:]+)(?:\{model_name="[^"]*"\})? (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def settled(server: ServerProcess) -> dict[str, float]:
    """A scrape taken once the engine thread has recorded the step after the last response
    (responses can be sent before the step's stats are fed): running and waiting both 0."""
    for _ in range(1000):
        s = scrape(server)
        if s["mlaserve:num_requests_running"] == 0 and s["mlaserve:num_requests_waiting"] == 0:
            return s
    raise AssertionError("the server never went idle")


def test_queue_time_is_below_ttft_for_every_request(server: ServerProcess) -> None:
    # One request at a time: each delta of the histogram sums is that request's value.
    before = settled(server)
    for i in range(4):
        r = server.post("/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 3})
        assert r.status_code == 200
        after = settled(server)
        assert after["mlaserve:request_queue_time_seconds_count"] == (
            before["mlaserve:request_queue_time_seconds_count"] + 1
        )
        queue = (
            after["mlaserve:request_queue_time_seconds_sum"]
            - before["mlaserve:request_queue_time_seconds_sum"]
        )
        ttft = (
            after["mlaserve:time_to_first_token_seconds_sum"]
            - before["mlaserve:time_to_first_token_seconds_sum"]
        )
        prefill = (
            after["mlaserve:request_prefill_time_seconds_sum"]
            - before["mlaserve:request_prefill_time_seconds_sum"]
        )
        assert 0 <= queue < ttft
        assert prefill > 0 and queue + prefill == pytest.approx(ttft, abs=1e-3)
        for name in NEW_FAMILIES:
            assert after[name] > before[name], name
        prompt = (
            after["mlaserve:request_prompt_tokens_sum"]
            - before["mlaserve:request_prompt_tokens_sum"]
        )
        generated = (
            after["mlaserve:request_generation_tokens_sum"]
            - before["mlaserve:request_generation_tokens_sum"]
        )
        assert prompt == r.json()["usage"]["prompt_tokens"]
        assert generated == r.json()["usage"]["completion_tokens"] == 3
        # Prefill + 2 decode steps at least: the iterations ran every token exactly once.
        steps = (
            after["mlaserve:iteration_tokens_total_count"]
            - before["mlaserve:iteration_tokens_total_count"]
        )
        tokens = (
            after["mlaserve:iteration_tokens_total_sum"]
            - before["mlaserve:iteration_tokens_total_sum"]
        )
        assert steps >= 3 and tokens == prompt + generated - 1
        before = after


def test_preemptions_are_counted(model_dir, tmp_path) -> None:
    # 11 usable pages of 4 tokens; four requests that each grow to 40 tokens (10 pages).
    proc = start_server(
        model_dir, tmp_path / "server.log",
        "--page-size", "4", "--num-pages", "12", "--max-num-seqs", "4",
    )  # fmt: skip
    try:
        proc.wait_ready()
        assert scrape(proc)["mlaserve:num_preemptions_total"] == 0
        prompt = list(range(3, 23))  # 20 tokens

        def one(_: int) -> int:
            body = {"prompt": prompt, "max_tokens": 20, "ignore_eos": True, "temperature": 0}
            return proc.post("/v1/completions", json=body).json()["usage"]["completion_tokens"]

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(4))) == [20] * 4
        assert scrape(proc)["mlaserve:num_preemptions_total"] > 0
    finally:
        proc.stop()
