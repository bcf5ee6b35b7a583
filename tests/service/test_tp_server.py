"""`mlaserve serve -tp 2` on the CPU (gloo): the official client gets TP1's greedy text, and
SIGTERM stops the server, its engine and the tensor-parallel worker in time, leaving no process.
A rank killed mid-stream (CPU, and 2 GPUs where present): the open stream ends with
`engine_dead`, /health turns 503, the server exits 1 and no process is left (on any GPU)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from mlaserve import LLM, SamplingParams
from tests.service.server_failure import (
    EXIT_WAIT_S,
    HealthPoller,
    assert_all_exit,
    stream_until_error,
)
from tests.service.server_process import descendants, start_server

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n"]


def test_tp2_server_serves_tp1_text_and_stops_cleanly(tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(device="cpu")
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    del llm

    server = start_server(None, tmp_path / "server.log", "-tp", "2")
    try:
        server.wait_ready()
        below = descendants(server.proc.pid)
        assert len(below) >= 2, f"engine and worker processes expected, got {below}"
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        model = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS, expected):
            got = client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert got.choices[0].text == text
        code = server.stop(timeout=60.0)
    finally:
        server.stop()
    logs = server.logs()
    assert code == 0, logs
    # the engine stopped its worker and exited, not killed past the shutdown timeout
    assert "did not stop" not in logs, logs
    assert_all_exit(below)


def _gpu_pids() -> set[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {int(x) for x in out.split()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_killed_rank_fails_the_open_stream_and_leaves_no_process(
    tmp_path: Path, device: str
) -> None:
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    server = start_server(None, tmp_path / "server.log", "-tp", "2", "--device", device)
    try:
        server.wait_ready(timeout=600)
        below = descendants(server.proc.pid)
        match = re.search(r"tensor parallel: 2 ranks \(\w+\), workers \[(\d+)\]", server.logs())
        assert match, server.logs()
        worker = int(match.group(1))
        assert worker in below
        poller = HealthPoller(server.url)
        t0 = []
        error = stream_until_error(
            server, lambda: (poller.start(), t0.append(time.monotonic()),
                             os.kill(worker, signal.SIGKILL)),
        )  # fmt: skip
        failed_after = time.monotonic() - t0[0]
        assert error["code"] == "engine_dead", error
        # the engine is dead before this error is sent: 503 now, or already gone
        with contextlib.suppress(httpx.TransportError):
            assert httpx.get(f"{server.url}/health", timeout=5.0).status_code == 503
        assert server.proc.wait(EXIT_WAIT_S) == 1
        poller.stop.set()
        poller.join()
    finally:
        server.stop(signal.SIGKILL)
    codes = poller.codes_never_up_again()
    print(
        f"{device}: the stream failed {failed_after:.2f} s after the kill: {error['message']!r}"
        f"; /health: {codes.count(200)} x 200, {codes.count(503)} x 503, then refused"
    )
    assert_all_exit(below)
    if device == "cuda" and shutil.which("nvidia-smi"):
        assert not _gpu_pids() & (below | {server.proc.pid}), "a process still holds a GPU"


def test_a_rank_killed_while_idle_fails_the_server_without_a_request(tmp_path: Path) -> None:
    """The idle engine checks its group every `IDLE_CHECK_S` (`LLMEngine.check_health`): a rank
    lost between requests turns /health 503 and exits the server, as an orchestrator's probe
    needs, instead of waiting for the next request to find it."""
    server = start_server(None, tmp_path / "server.log", "-tp", "2")
    try:
        server.wait_ready(timeout=600)
        below = descendants(server.proc.pid)
        match = re.search(r"tensor parallel: 2 ranks \(\w+\), workers \[(\d+)\]", server.logs())
        assert match, server.logs()
        poller = HealthPoller(server.url)
        poller.start()
        t0 = time.monotonic()
        os.kill(int(match.group(1)), signal.SIGKILL)
        assert server.proc.wait(EXIT_WAIT_S) == 1
        exited_after = time.monotonic() - t0
        poller.stop.set()
        poller.join()
    finally:
        server.stop(signal.SIGKILL)
    codes = poller.codes_never_up_again()
    assert "the engine died" in server.logs() and "exited" in server.logs(), server.logs()
    print(f"idle: the server exited {exited_after:.2f} s after the kill; /health: "
          f"{codes.count(200)} x 200, {codes.count(503)} x 503, then refused")  # fmt: skip
    assert_all_exit(below)
