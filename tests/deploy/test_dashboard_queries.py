"""Every query of the Grafana dashboard, run for real: a `mlaserve serve` subprocess serving
the image's default model, a real Prometheus (Debian's package) scraping it with
docker/prometheus.yml (target pointed at the local server), traffic sent with the `openai`
client, then each expression through Prometheus's HTTP range-query API, as Grafana sends it.

Each expression must parse and return data: at least one finite value, and one above zero
unless it is listed below as zero-or-empty here, with the reason.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from tests.deploy import dashboard as dash
from tests.deploy.exposition import exposed_metric_names
from tests.service.server_process import ServerProcess, free_port, start_server

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SPEC = (
    "speculative decoding is not in the engine yet (the lead is building it); start the server "
    "with speculation here once it lands and drop these entries"
)
# Panel / legend -> why the expression can only be empty, NaN or zero on this CPU server.
ZERO_OR_EMPTY_HERE = {
    "Accept length / mean accept length": SPEC,
    "Accept length / p50 accept length": SPEC,
    "Acceptance rate by draft position / position {{position}}": SPEC,
    "Acceptance rate by draft position / all positions": SPEC,
    "Graph replays vs eager steps / graph replays": "no CUDA graphs on a CPU server",
    "Compiles while serving / compiles": "expected 0 everywhere: it is an alarm",
    "Prefix cache hit rate / hit rate (tokens)": "prefix caching is off by default and this "
    "server runs without --enable-prefix-caching: 0 tokens queried, the ratio is NaN",
}
# Zero is a valid answer for these, but they must answer (the series exist).
MUST_ANSWER = {"Compiles while serving / compiles", "Graph replays vs eager steps / graph replays"}

# Rounds of NUM_REQUESTS concurrent requests against max_num_seqs 2: the queue is non-empty
# for 7/8 of each round, and rounds go on for at least MIN_TRAFFIC_S, so scrapes (every
# SCRAPE_S) see running and waiting requests above 0 however fast the machine is.
NUM_REQUESTS = 16
MAX_TOKENS = 32
MIN_TRAFFIC_S = 6.0
MAX_ROUNDS = 20
SCRAPE_S = 1


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        response.raise_for_status()
        return response.json()["data"]["result"]

    def query_range(self, expr: str, start: float, end: float) -> dict:
        """The API's whole answer: a parse error is a 400 with status "error"."""
        params = {"query": expr, "start": start, "end": end, "step": f"{SCRAPE_S}s"}
        return httpx.get(f"{self.url}/api/v1/query_range", params=params, timeout=30).json()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    proc = start_server(
        None,  # the default model the image serves
        tmp_path_factory.mktemp("deploy-server") / "server.log",
        "--max-num-seqs", "2", "--max-queue", "64",
    )  # fmt: skip
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def prometheus(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory):
    if not os.path.exists(PROMETHEUS):
        pytest.skip("no prometheus binary: run tests/service/install_prometheus.sh (apt)")
    work = tmp_path_factory.mktemp("deploy-prometheus")
    # docker/prometheus.yml as shipped, pointed at the local server and scraping every second.
    config = yaml.safe_load((dash.REPO_ROOT / "docker" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_S}s", evaluation_interval=f"{SCRAPE_S}s")
    (job,) = config["scrape_configs"]
    job.update(scrape_interval=f"{SCRAPE_S}s", scrape_timeout=f"{SCRAPE_S}s")
    job["static_configs"] = [{"targets": [f"127.0.0.1:{server.port}"]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = work / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                up = prom.query(f'up{{job="{job["job_name"]}"}}')
                if up and up[0]["value"][1] == "1":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            pytest.fail(f"prometheus never scraped the server:\n{log_path.read_text()}")
        yield prom
    finally:
        proc.terminate()
        proc.wait(10)


def send_traffic(server: ServerProcess) -> int:
    """Rounds of NUM_REQUESTS completions at once, half streamed, through the official client,
    for at least MIN_TRAFFIC_S; returns the number of requests sent."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            kwargs = dict(model=model, prompt=f"def f{i}(x):", max_tokens=MAX_TOKENS)
            if i % 2:
                for _ in client.completions.create(
                    **kwargs, stream=True, extra_body={"ignore_eos": True}
                ):
                    pass
            else:
                client.completions.create(**kwargs, extra_body={"ignore_eos": True})
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    started, sent = time.monotonic(), 0
    while time.monotonic() - started < MIN_TRAFFIC_S and sent < MAX_ROUNDS * NUM_REQUESTS:
        threads = [threading.Thread(target=one, args=(sent + i,)) for i in range(NUM_REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        sent += NUM_REQUESTS
        assert not errors, errors
    client.close()
    return sent


@pytest.fixture(scope="module")
def traffic_window(server: ServerProcess, prometheus: Prometheus) -> tuple[float, float]:
    """Send traffic; returns (start, end) once Prometheus has scraped all of it."""
    time.sleep(2 * SCRAPE_S)  # some idle samples before, so rates have a baseline
    start = time.time()
    sent = send_traffic(server)
    expected = server.metric("mlaserve:generation_tokens_total")
    assert expected == sent * MAX_TOKENS
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        result = prometheus.query("sum(mlaserve:generation_tokens_total)")
        if result and float(result[0]["value"][1]) == expected:
            break
        time.sleep(0.25)
    else:
        pytest.fail("prometheus never caught up with the traffic")
    time.sleep(2 * SCRAPE_S)
    return start - 2 * SCRAPE_S, time.time()


def test_every_dashboard_metric_is_in_metrics(server: ServerProcess) -> None:
    dashboard = dash.load()
    exposed = exposed_metric_names(server.get("/metrics").text)
    used = set().union(*(q.metric_names for q in dash.queries(dashboard)))
    used |= dash.variable_metric_names(dashboard)
    assert not used - exposed, f"not in /metrics: {sorted(used - exposed)}"


def test_the_model_variable_finds_the_served_model(
    server: ServerProcess, prometheus: Prometheus, traffic_window: tuple[float, float]
) -> None:
    # Grafana's label_values(METRIC, model_name) is this series query.
    (metric,) = dash.variable_metric_names(dash.load())
    models = {r["metric"]["model_name"] for r in prometheus.query(metric)}
    assert models == {server.get("/v1/models").json()["data"][0]["id"]}


def test_every_dashboard_query_returns_data(
    prometheus: Prometheus, traffic_window: tuple[float, float]
) -> None:
    start, end = traffic_window
    queries = dash.queries(dash.load())
    keys = {q.key for q in queries}
    assert set(ZERO_OR_EMPTY_HERE) <= keys, f"stale entries: {set(ZERO_OR_EMPTY_HERE) - keys}"
    failures = []
    for query in queries:
        answer = prometheus.query_range(query.promql(), start, end)
        if answer.get("status") != "success":
            failures.append(f"{query.key}: {answer.get('error')} in {query.promql()}")
            continue
        values = [
            float(v)
            for series in answer["data"]["result"]
            for _, v in series["values"]
            if not math.isnan(float(v))
        ]
        if query.key in ZERO_OR_EMPTY_HERE:
            if query.key in MUST_ANSWER and not values:
                failures.append(f"{query.key}: no data (expected a 0 series)")
            continue
        if not values:
            failures.append(f"{query.key}: no data for {query.promql()}")
        elif not any(v > 0 for v in values):
            failures.append(f"{query.key}: only zeros during traffic for {query.promql()}")
    assert not failures, "\n".join(failures)


def test_a_broken_query_is_caught(
    prometheus: Prometheus, traffic_window: tuple[float, float]
) -> None:
    """The check above can fail: a parse error and a misspelt metric are both reported."""
    start, end = traffic_window
    assert (
        prometheus.query_range("sum(rate(mlaserve:generation_tokens_total[30s])", start, end)[
            "status"
        ]
        == "error"
    )
    answer = prometheus.query_range("rate(mlaserve:generation_token_total[30s])", start, end)
    assert answer["status"] == "success" and answer["data"]["result"] == []
