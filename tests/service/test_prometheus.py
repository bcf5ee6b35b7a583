"""A real Prometheus (Debian's package) scrapes /metrics every second; its query API must show
TTFT, TPOT and token counters that match the requests the test sent."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx
import pytest

from tests.service.server_process import ServerProcess, free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
M = "mlaserve:"


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> float | None:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=5)
        response.raise_for_status()
        result = response.json()["data"]["result"]
        return float(sum(float(r["value"][1]) for r in result)) if result else None

    def wait_for(self, expr: str, expected: float, timeout: float = 20.0) -> float | None:
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.query(expr)
            if value is not None and value == pytest.approx(expected):
                return value
            time.sleep(0.25)
        return value


@pytest.fixture(scope="module")
def prometheus(server: ServerProcess, tmp_path_factory):
    if not os.path.exists(PROMETHEUS):
        pytest.skip("no prometheus binary: run tests/service/install_prometheus.sh (apt)")
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: mlaserve\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{server.port}']\n"
    )
    port = free_port()
    log = open(work / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if prom.query('up{job="mlaserve"}') == 1.0:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            pytest.fail(
                f"prometheus never scraped the server:\n{(work / 'prometheus.log').read_text()}"
            )
        yield prom
    finally:
        proc.terminate()
        proc.wait(10)


def test_prometheus_sees_what_was_sent(server: ServerProcess, prometheus: Prometheus) -> None:
    names = {
        "gen": f"{M}generation_tokens_total",
        "prompt": f"{M}prompt_tokens_total",
        "ttft_n": f"{M}time_to_first_token_seconds_count",
        "ttft_sum": f"{M}time_to_first_token_seconds_sum",
        "itl_n": f"{M}inter_token_latency_seconds_count",
        "itl_sum": f"{M}inter_token_latency_seconds_sum",
        "tpot_n": f"{M}request_time_per_output_token_seconds_count",
        "e2e_n": f"{M}e2e_request_latency_seconds_count",
        "e2e_sum": f"{M}e2e_request_latency_seconds_sum",
        "queue_n": f"{M}request_queue_time_seconds_count",
    }
    before = {k: server.metric(v) for k, v in names.items()}
    length_before = server.metric(f"{M}request_success_total", finished_reason="length")

    prompts = ["Hello world", "The quick brown fox", "What is the capital of France?", "42"]
    prompt_lens = [server.post("/tokenize", json={"prompt": p}).json()["count"] for p in prompts]
    started = time.monotonic()
    for i, prompt in enumerate(prompts):
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": i % 2 == 1}
        assert server.post("/v1/completions", json=body).status_code == 200
    wall = time.monotonic() - started

    # Counters: exact. Prometheus' last scrape must catch up with the 4 requests.
    expected_gen = before["gen"] + 4 * 6
    assert prometheus.wait_for(names["gen"], expected_gen) == pytest.approx(expected_gen)
    assert prometheus.query(names["prompt"]) == before["prompt"] + sum(prompt_lens)
    length = prometheus.query(f'{M}request_success_total{{finished_reason="length"}}')
    assert length == length_before + 4
    # Histograms: one TTFT / TPOT / e2e / queue sample per request, 5 inter-token gaps each.
    got = {k: prometheus.query(v) for k, v in names.items()}
    assert got["ttft_n"] == before["ttft_n"] + 4
    assert got["tpot_n"] == before["tpot_n"] + 4
    assert got["e2e_n"] == before["e2e_n"] + 4
    assert got["queue_n"] == before["queue_n"] + 4
    assert got["itl_n"] == before["itl_n"] + 4 * 5
    ttft = got["ttft_sum"] - before["ttft_sum"]
    itl = got["itl_sum"] - before["itl_sum"]
    e2e = got["e2e_sum"] - before["e2e_sum"]
    assert 0 < ttft < e2e <= wall
    assert 0 < itl < e2e
    assert e2e == pytest.approx(ttft + itl, rel=0.25, abs=0.05)  # e2e = TTFT + the token gaps
    # Gauges are scraped too, and the metric types are what dashboards expect.
    assert prometheus.query(f"{M}num_requests_running") == 0
    assert prometheus.query(f"{M}kv_cache_usage_perc") == 0
    meta = httpx.get(f"{prometheus.url}/api/v1/metadata").json()["data"]
    assert meta[f"{M}time_to_first_token_seconds"][0]["type"] == "histogram"
    assert meta[f"{M}inter_token_latency_seconds"][0]["type"] == "histogram"
    assert meta[f"{M}generation_tokens_total"][0]["type"] == "counter"
    assert meta[f"{M}num_requests_running"][0]["type"] == "gauge"
    quantile = prometheus.query(
        f"histogram_quantile(0.5, sum by (le) ({M}inter_token_latency_seconds_bucket))"
    )
    assert quantile is not None and 0 < quantile < 10
