"""`mlaserve serve --nnodes 2` on the CPU (gloo), two launchers on one host as two nodes: node 0
serves the official client the same greedy text as single-process TP of the same N, and a
SIGTERM stops both nodes with code 0; killing node 1's launcher mid-stream ends the open stream
with `engine_dead`, turns /health away from 200 and exits node 0 with 1, and so does killing it
while node 0 is idle (no request needed to notice); killing node 0 exits
node 1 with 1; a rendezvous whose node never comes fails naming the missing ranks; a node 1
whose node 0 never comes fails naming the store. No process is left in any case."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from mlaserve import LLM, SamplingParams
from mlaserve.engine.tp_heartbeat import LOST_AFTER_S
from tests.service.server_failure import (
    EXIT_WAIT_S,
    HealthPoller,
    assert_all_exit,
    stream_until_error,
)
from tests.service.server_process import ServerProcess, descendants, free_port, start_server

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n"]
MAX_TOKENS = 12


def _start_nodes(tmp_path: Path, tp: int, timeout_s: float = 300.0) -> list[ServerProcess]:
    """Node 0 (the server) and node 1 (a launcher), meeting at a free local port."""
    addr = f"127.0.0.1:{free_port()}"
    common = ("-tp", str(tp), "--nnodes", "2", "--dist-init-addr", addr,
              "--dist-timeout", str(timeout_s))  # fmt: skip
    return [
        start_server(None, tmp_path / f"node{r}.log", *common, "--node-rank", str(r))
        for r in (0, 1)
    ]


def _all_pids(nodes: list[ServerProcess]) -> set[int]:
    return {pid for n in nodes for pid in descendants(n.proc.pid) | {n.proc.pid}}


@pytest.mark.slow
def test_two_nodes_serve_single_process_tp_text_and_stop_together(tmp_path: Path) -> None:
    tp = 4  # two ranks per node: node 0's rank 1 and node 1's ranks 2, 3 are spawned
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(device="cpu", tensor_parallel_size=tp)
    try:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()
        del llm
    nodes = _start_nodes(tmp_path, tp)
    try:
        nodes[0].wait_ready(timeout=600)
        pids = _all_pids(nodes)
        assert len(descendants(nodes[1].proc.pid)) >= 2, "node 1's two ranks expected"
        client = OpenAI(base_url=f"{nodes[0].url}/v1", api_key="none")
        model = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS, expected):
            got = client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert got.choices[0].text == text
        assert nodes[0].stop(timeout=60.0) == 0, nodes[0].logs()
        # node 0 sent its ranks' stop message: node 1's ranks exit 0, and so does its launcher
        assert nodes[1].proc.wait(EXIT_WAIT_S) == 0, nodes[1].logs()
    finally:
        for node in nodes:
            node.stop(signal.SIGKILL)
    assert "no custom all-reduce" in nodes[0].logs()
    assert_all_exit(pids)


@pytest.mark.slow
def test_a_lost_worker_node_fails_the_open_stream_and_exits_node_0(tmp_path: Path) -> None:
    nodes = _start_nodes(tmp_path, 2)
    try:
        nodes[0].wait_ready(timeout=600)
        pids = _all_pids(nodes)
        poller = HealthPoller(nodes[0].url)
        error = stream_until_error(
            nodes[0], lambda: (poller.start(), os.kill(nodes[1].proc.pid, signal.SIGKILL))
        )
        assert error["code"] == "engine_dead", error
        with contextlib.suppress(httpx.TransportError):  # 503 now, or already gone
            assert httpx.get(f"{nodes[0].url}/health", timeout=5.0).status_code == 503
        assert nodes[0].proc.wait(EXIT_WAIT_S) == 1
        poller.stop.set()
        poller.join()
    finally:
        for node in nodes:
            node.stop(signal.SIGKILL)
    codes = poller.codes_never_up_again()
    print(f"{error['message']!r}; /health: {codes.count(200)} x 200, {codes.count(503)} x 503")
    assert_all_exit(pids)


@pytest.mark.slow
def test_a_worker_node_lost_while_idle_exits_node_0_without_a_request(tmp_path: Path) -> None:
    """No request finds the loss: node 1's heartbeat stops, rank 0 reports the node lost after
    `LOST_AFTER_S`, and the idle engine's health check (`LLMEngine.check_health`) fails it."""
    nodes = _start_nodes(tmp_path, 2)
    try:
        nodes[0].wait_ready(timeout=600)
        pids = _all_pids(nodes)
        t0 = time.monotonic()
        os.kill(nodes[1].proc.pid, signal.SIGKILL)
        assert nodes[0].proc.wait(LOST_AFTER_S + EXIT_WAIT_S) == 1, nodes[0].logs()
        exited_after = time.monotonic() - t0
    finally:
        for node in nodes:
            node.stop(signal.SIGKILL)
    assert "node 1" in nodes[0].logs() and "the engine died" in nodes[0].logs(), nodes[0].logs()
    print(f"node 0 exited {exited_after:.1f} s after node 1's launcher was killed, idle")
    assert_all_exit(pids)


@pytest.mark.slow
def test_a_lost_node_0_exits_the_worker_node(tmp_path: Path) -> None:
    nodes = _start_nodes(tmp_path, 2)
    try:
        nodes[0].wait_ready(timeout=600)
        pids = _all_pids(nodes)
        for pid in descendants(nodes[0].proc.pid) | {nodes[0].proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # the machine is gone: nothing of node 0 stops
        assert nodes[1].proc.wait(EXIT_WAIT_S) == 1, nodes[1].logs()
    finally:
        for node in nodes:
            node.stop(signal.SIGKILL)
    assert_all_exit(pids)


def test_a_rendezvous_without_node_1_fails_naming_its_ranks(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    node0 = start_server(
        None, tmp_path / "node0.log", "-tp", "2", "--nnodes", "2", "--node-rank", "0",
        "--dist-init-addr", addr, "--dist-timeout", "3",
    )  # fmt: skip
    try:
        assert node0.proc.wait(120) == 1, node0.logs()
    finally:
        node0.stop(signal.SIGKILL)
    assert f"rendezvous at {addr}: rank(s) [1] of 2 (node(s) [1]) did not join within 3 s" in (
        node0.logs()
    )


def test_a_node_without_node_0_fails_naming_the_store(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    node1 = start_server(
        None, tmp_path / "node1.log", "-tp", "2", "--nnodes", "2", "--node-rank", "1",
        "--dist-init-addr", addr, "--dist-timeout", "3",
    )  # fmt: skip
    try:
        assert node1.proc.wait(120) == 1, node1.logs()
    finally:
        node1.stop(signal.SIGKILL)
    assert f"could not reach node 0's store at {addr}" in node1.logs()
    assert not descendants(node1.proc.pid)
    print(f"node 1 gave up after {time.monotonic() - t0:.1f} s")
