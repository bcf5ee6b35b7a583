"""The engine process against real servers: it never outlives the server, however the server
ends (SIGTERM drain, SIGKILL), and it is not the one that answers a Ctrl-C; it freezes its heap
once warmed up; and its command thread compiles structured requests' grammars off the engine
loop."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import signal
import time
from pathlib import Path

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.sampling_params import StructuredOutputsParams
from mlaserve.service.engine_core import ADD, ADDED, EngineCore
from mlaserve.service.request_stream import SubRequest
from tests.service.server_process import ServerProcess, start_server

BODY = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}


def _engine_pid(proc: ServerProcess) -> int:
    match = re.search(r"engine process started \(pid (\d+)\)", proc.logs())
    assert match, proc.logs()
    pid = int(match.group(1))
    assert pid != proc.proc.pid
    return pid


def _exists(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _exists(pid):
            return True
        time.sleep(0.05)
    return False


def test_engine_process_stops_with_the_server(model_dir, tmp_path) -> None:
    proc = start_server(model_dir, tmp_path / "server.log", "--page-size", "16")
    try:
        proc.wait_ready()
        pid = _engine_pid(proc)
        assert _exists(pid)
        # Ready means warmed up, and the engine process's long-lived heap frozen (no collector
        # pass over the model's objects while serving)
        frozen = re.search(r"froze the engine process's heap: (\d+) objects", proc.logs())
        assert frozen and int(frozen.group(1)) > 10_000, proc.logs()
        assert proc.post("/v1/completions", json=BODY).status_code == 200
        # A Ctrl-C reaches the whole process group; the engine process ignores it, so the
        # server still drains and serves (here: nothing to drain, it exits 0).
        os.kill(pid, signal.SIGINT)
        assert proc.post("/v1/completions", json=BODY).status_code == 200
    finally:
        code = proc.stop()
    assert code == 0, proc.logs()
    assert _wait_gone(pid, timeout=5.0)


def test_engine_process_exits_when_the_server_is_killed(model_dir, tmp_path) -> None:
    proc = start_server(model_dir, tmp_path / "server.log", "--page-size", "16")
    try:
        proc.wait_ready()
        pid = _engine_pid(proc)
        assert proc.post("/v1/completions", json=BODY).status_code == 200
    finally:
        proc.stop(signal.SIGKILL)  # no exit hook, no lifespan: only the pipe's EOF tells it
    assert _wait_gone(pid), f"engine process {pid} outlived the killed server"
    if _exists(pid):  # pragma: no cover - clean up after a failure
        os.kill(pid, signal.SIGKILL)


def test_grammars_compile_on_the_command_thread(model_dir) -> None:
    """`_compile_grammars` (what the command thread runs on every ADD before queueing it)
    attaches each structured request's compiled matcher, or the refusal; the loop's `_apply`
    then adds the requests without compiling anything on the engine loop."""
    pytest.importorskip("xgrammar")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", page_size=16)
    engine = llm.engine
    commands_out, _ = multiprocessing.Pipe(duplex=False)
    outputs_out, outputs_in = multiprocessing.Pipe(duplex=False)
    core = EngineCore(engine.config, commands_out, outputs_in, None, None)
    core._engine = engine
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    good = SubRequest("good", [5, 6, 7], structured)
    plain = SubRequest("plain", [5, 6], SamplingParams(max_tokens=2))

    command = core._compile_grammars((ADD, 1, [good, plain], time.time()))
    assert set(command[4]) == {"good"}
    core._apply(engine, command)
    assert pickle.loads(outputs_out.recv_bytes()) == (ADDED, 1, None, ["good", "plain"])
    assert engine.requests["good"].grammar is command[4]["good"]
    assert engine.requests["plain"].grammar is None
    assert engine.num_grammar_compiles_on_add == 0

    nonsense = StructuredOutputsParams(json={"type": "nonsense"})
    bad = SubRequest("bad", [5], SamplingParams(max_tokens=4, structured_outputs=nonsense))
    command = core._compile_grammars((ADD, 2, [bad], time.time()))
    assert isinstance(command[4], ValueError)
    core._apply(engine, command)
    _, add_id, error, added = pickle.loads(outputs_out.recv_bytes())
    assert (add_id, added) == (2, [])
    assert getattr(error, "param", None) == "structured_outputs", error
    assert "bad" not in engine.requests
    plain_add = (ADD, 3, [SubRequest("p2", [5], SamplingParams(max_tokens=2))], time.time())
    assert core._compile_grammars(plain_add) is plain_add  # nothing to compile: untouched
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_free_pages == engine.get_stats().num_total_pages
