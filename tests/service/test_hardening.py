"""Issue 13 against real servers: cheap requests cannot stall the server, streamed logprobs match
non-streamed ones with stop strings, an engine-thread crash exits the process, thread count."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from tests.service.server_process import REPO_ROOT, ServerProcess, free_port, start_server

GREEDY_STOP = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "stop": ["qqqqzz", "\n\n\n"]}


# ----- logprobs offsets (shared server) -----
def _streamed(server: ServerProcess, path: str, body: dict) -> list[dict]:
    with server.http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        frames = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f)["choices"][0] for f in frames[:-1] if json.loads(f)["choices"]]


@pytest.mark.parametrize("stop", [True, False], ids=["stop-strings", "no-stop"])
def test_streamed_completion_logprobs_equal_non_streamed(server, stop) -> None:
    body = {"prompt": "def fibonacci(n):", "logprobs": 2, **GREEDY_STOP}
    if not stop:
        del body["stop"]
    # Each from an empty prefix cache: a hit prefills through the prefix path, whose float
    # rounding may differ in the last bits, and this compares the two outputs exactly.
    server.post("/reset_prefix_cache").raise_for_status()
    whole = server.post("/v1/completions", json=body).json()["choices"][0]
    server.post("/reset_prefix_cache").raise_for_status()
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}  # fmt: skip
    for choice in _streamed(server, "/v1/completions", body):
        for key in merged:
            merged[key].extend(choice["logprobs"][key])
    assert merged == whole["logprobs"]  # text_offset included (was [0,0,0,0,2,...] with stop)
    assert len(merged["tokens"]) == 24


def test_streamed_chat_logprobs_equal_non_streamed(server) -> None:
    body = {"messages": [{"role": "user", "content": "Sort a list."}], "logprobs": True,
            "top_logprobs": 2, **GREEDY_STOP}  # fmt: skip
    # Each from an empty prefix cache: a hit prefills through the prefix path, whose float
    # rounding may differ in the last bits, and this compares the two outputs exactly.
    server.post("/reset_prefix_cache").raise_for_status()
    whole = server.post("/v1/chat/completions", json=body).json()["choices"][0]
    server.post("/reset_prefix_cache").raise_for_status()
    content = [e for c in _streamed(server, "/v1/chat/completions", body) if c.get("logprobs")
               for e in c["logprobs"]["content"]]  # fmt: skip
    assert content == whole["logprobs"]["content"]


# ----- nothing one client sends stalls /health (own server, default 8 MiB body limit) -----
MAX_BODY = 8 * 1024 * 1024


def _bodies() -> list[tuple[str, bytes, set[int]]]:
    tiny = json.dumps({"prompt": ["a"] * (MAX_BODY // 5 - 10), "max_tokens": 1})
    nested = json.dumps({"prompt": [[1]] * (MAX_BODY // 5 - 10), "max_tokens": 1})
    one_text = json.dumps({"prompt": "x" * (MAX_BODY - 100), "max_tokens": 1})
    # Under every structural limit, but ~150k prompt tokens by the lower bound: no tokenizing.
    many_texts = json.dumps({"prompt": ["def f(x): return x " * 190] * 2000, "max_tokens": 1})
    return [
        ("tiny-prompts", tiny.encode(), {413}),
        ("nested-token-lists", nested.encode(), {413}),
        ("one-huge-text", one_text.encode(), {400}),
        ("many-long-texts", many_texts.encode(), {400}),
    ]


@pytest.fixture(scope="module")
def big_server(model_dir, tmp_path_factory):
    proc = start_server(model_dir, tmp_path_factory.mktemp("big-server") / "server.log",
                        "--max-prompt-tokens-per-request", "300")  # fmt: skip
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


# The attacker is another process, so that its own work does not delay the probes' client.
_ATTACKER = """
import sys, time, httpx
url, seconds, paths = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
bodies = [(p, open(p, "rb").read()) for p in paths]
end = time.monotonic() + seconds
with httpx.Client(timeout=120) as client:
    while time.monotonic() < end:
        for path, body in bodies:
            t0 = time.perf_counter()
            try:
                status = client.post(url + "/v1/completions", content=body,
                                     headers={"content-type": "application/json"}).status_code
            except httpx.TransportError as e:  # refused mid-upload: the connection closed
                status = type(e).__name__
            print(path, status, time.perf_counter() - t0, flush=True)
"""


def test_health_keeps_answering_while_huge_requests_are_refused(big_server, tmp_path) -> None:
    """Huge bodies are refused with their status (413 before parsing, 400 before tokenizing) while
    /health keeps answering. How fast it answers is measured by `bench/health_stall.py` (issue
    13's p99 <= 100 ms), not asserted here: tests make no timed assertions, and on a loaded
    2-core CI machine a p99 bound failed spuriously. With `-s` the test prints the p99 and the
    slowest refusal (was 4.8 s and up before the refusals moved ahead of the work)."""
    expected = {}
    for name, body, codes in _bodies():
        (tmp_path / name).write_bytes(body)
        expected[str(tmp_path / name)] = codes
    attacker = subprocess.Popen(
        [sys.executable, "-c", _ATTACKER, big_server.url, "6", *expected],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    latencies = []
    try:
        with httpx.Client(base_url=big_server.url, timeout=30) as probe:
            time.sleep(0.5)
            for _ in range(50):
                t0 = time.perf_counter()
                assert probe.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)
    finally:
        out, _ = attacker.communicate(timeout=120)
    results = [line.split() for line in out.splitlines()]
    for path, status, _ in results:
        assert int(status) in expected[path] if status.isdigit() else True, (path, status)
    answered = {path for path, status, _ in results if status.isdigit()}
    assert len(answered) >= 3, results
    p99 = statistics.quantiles(latencies, n=100)[98]
    slowest = max(float(elapsed) for _, _, elapsed in results)
    print(f"/health p99 {p99 * 1e3:.0f} ms over {len(latencies)} probes; slowest refusal "
          f"{slowest:.2f} s over {len(results)} huge requests")  # fmt: skip


def test_prompt_token_budget_is_checked_before_and_while_tokenizing(big_server) -> None:
    # Three prompts that each fit the context (256) but together break the budget (300).
    text = "x = [1, 2, 3]\n"
    while (n := big_server.post("/tokenize", json={"prompt": text}).json()["count"]) < 110:
        text += "x = [1, 2, 3]\n"
    assert n < 250
    r = big_server.post("/v1/completions", json={"prompt": [text] * 3, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens", r.text
    r = big_server.post("/v1/completions", json={"prompt": [[5] * n] * 3, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens", r.text
    assert big_server.post(
        "/v1/completions", json={"prompt": [text] * 2, "max_tokens": 1}
    ).is_success


# ----- an engine that dies takes the server down (own server) -----
DIE_AFTER_STEPS = 30
# The patch runs at import, so that it also runs in the engine process: `spawn` re-imports this
# script there as `__mp_main__`, without the `__main__` block.
_DYING_SERVER = f"""
import sys
from mlaserve.llm_engine import LLMEngine
from mlaserve.service.cli import main

real_step, steps = LLMEngine.step, 0

def step(self):  # a device fault {DIE_AFTER_STEPS} steps after warm-up
    global steps
    if "__warmup__" not in self.requests:
        steps += 1
        if steps > {DIE_AFTER_STEPS}:
            raise RuntimeError("injected device fault")
    return real_step(self)

LLMEngine.step = step
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


def test_engine_thread_death_fails_open_requests_and_exits_1(model_dir, tmp_path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    script = tmp_path / "dying_server.py"
    script.write_text(_DYING_SERVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLASERVE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            [sys.executable, str(script), "serve", "--port", str(port), "--device", "cpu",
             "--model", str(model_dir)],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    proc = ServerProcess(popen, port, log_path, None)
    try:
        proc.wait_ready()
        body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with proc.http.stream("POST", "/v1/completions", json=body) as response:
            frames = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert frames[-1] == "data: [DONE]"
        error = json.loads(frames[-2].removeprefix("data: "))["error"]
        assert error["code"] == "engine_dead" and "injected device fault" in error["message"]
        assert popen.wait(30) == 1  # was: stays up, /health 503 forever
        logs = proc.logs()
        assert logs.count("RuntimeError: injected device fault") == 1, logs  # the cause, once
        assert "exit code 1" in logs
    finally:
        proc.stop(signal.SIGKILL)


# ----- torch threads -----
def test_torch_threads_come_from_the_cpu_count_unless_set() -> None:
    from mlaserve.service.cli import SERVICE_THREADS, resolve_torch_threads  # new in issue 13

    cpus = len(os.sched_getaffinity(0))
    assert resolve_torch_threads(None, {}) == max(1, cpus - SERVICE_THREADS)
    assert resolve_torch_threads(3, {}) == 3
    assert resolve_torch_threads(None, {"OMP_NUM_THREADS": "2"}) is None  # torch reads it


def test_torch_threads_flag_reaches_the_engine_thread(model_dir, tmp_path) -> None:
    proc = start_server(model_dir, tmp_path / "server.log", "--torch-threads", "1")
    try:
        proc.wait_ready()
        assert "torch intra-op threads: 1" in proc.logs()
        assert "engine process: 1 torch intra-op threads" in proc.logs()  # applied there
    finally:
        assert proc.stop() == 0
