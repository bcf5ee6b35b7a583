"""`mlaserve serve` as an operator runs it: help, exit codes, and options from every source."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys

import pytest

from mlaserve.config import default_model_path
from mlaserve.service.cli import bind_socket
from mlaserve.service.settings import options
from tests.service.server_process import REPO_ROOT, free_port, start_server


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlaserve", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_help_documents_every_option_and_its_env_variable() -> None:
    done = _run("serve", "--help")
    assert done.returncode == 0
    for opt in options():
        assert opt.flag in done.stdout and opt.env in done.stdout
    assert "--config" in done.stdout and "MLASERVE_CONFIG" in done.stdout
    assert _run("--version").stdout.startswith("mlaserve ")


def test_connections_on_the_listening_socket_send_without_nagle() -> None:
    """asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets whose proto says TCP; with
    the default proto 0 each keep-alive response after the first (headers and body: two writes)
    waited ~40 ms for the client's delayed ACK (/health: 44 ms instead of ~1 ms)."""

    async def accepted_nodelay() -> int:
        sock = bind_socket("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def test_a_bad_option_exits_2_naming_it() -> None:
    done = _run("serve", "--page-size", "3")
    assert done.returncode == 2
    assert "page_size" in done.stderr and "(cli)" in done.stderr
    assert _run("serve", "--no-such-option", "1").returncode == 2


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    """The whole output of a refused start: one `mlaserve: error:` line, no traceback."""
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlaserve: error: "), lines
    return lines[0]


def test_a_bad_model_path_is_one_line_before_the_port_opens(tmp_path) -> None:
    port = free_port()
    done = _run("serve", "deepseek-ai/DeepSeek-V3", "--port", str(port), "--device", "cpu")
    assert done.returncode == 2
    line = _one_error_line(done)
    assert "'deepseek-ai/DeepSeek-V3' does not exist" in line and "Hugging Face hub" in line
    done = _run("serve", str(tmp_path), "--port", str(port))
    assert done.returncode == 2 and "has no config.json" in _one_error_line(done)
    done = _run("serve", "--max-model-len", "100000", "--port", str(port))
    assert done.returncode == 2 and "max_model_len" in _one_error_line(done)


def test_vllm_flags_with_values_out_of_range_are_one_line(tmp_path) -> None:
    for args, name in [
        (("-tp", "0"), "tensor_parallel_size"),
        (("--gpu-memory-utilization", "1.5"), "gpu_memory_utilization"),
        (("--max-logprobs", "21"), "max_logprobs"),
        (("--enable-auto-tool-choice",), "enable_auto_tool_choice"),
        (("--tool-call-parser", "hermes"), "tool_call_parser"),
        (("--chat-template", str(tmp_path / "missing.jinja")), "chat_template"),
    ]:
        done = _run("serve", *args)
        assert done.returncode == 2, args
        assert name in _one_error_line(done)


def test_a_model_that_cannot_load_exits_1(model_dir, tmp_path) -> None:
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, broken / name)
    proc = start_server(broken, tmp_path / "server.log")
    assert proc.proc.wait(60) == 1
    assert "safetensors" in proc.logs()


def test_a_taken_port_exits_1_with_one_line_and_no_engine(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run("serve", "--port", str(port), "--device", "cpu")
    assert done.returncode == 1
    line = _one_error_line(done)  # so nothing was loaded: no "loading weights", no "ready"
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_a_vllm_command_line_serves(tmp_path) -> None:
    """`vllm serve PATH ...` habits: positional model, vLLM's flag names, `-tp 1`, flags that
    are no-ops here (logged with the reason); --trust-remote-code on a tokenizer that ships no
    code changes nothing."""
    proc = start_server(
        None, tmp_path / "server.log", str(default_model_path()),
        "--gpu-memory-utilization", "0.5", "--max-model-len", "4096", "-tp", "1",
        "--enforce-eager", "--max-logprobs", "5", "--disable-log-requests",
        "--disable-uvicorn-access-log", "--trust-remote-code", "--disable-log-stats",
        "--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )  # fmt: skip
    try:
        proc.wait_ready()
        model = proc.get("/v1/models").json()["data"][0]
        assert model["root"] == str(default_model_path()) and model["max_model_len"] == 4096
        out = proc.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1
        too_many = proc.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1, "logprobs": 6}
        )
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
        # The template given on the command line renders chat prompts: the bare contents.
        tokens = proc.post("/tokenize", json={"messages": [{"role": "user", "content": "ab"}]})
        assert tokens.json()["tokens"] == proc.post("/tokenize", json={"prompt": "ab",
               "add_special_tokens": False}).json()["tokens"]  # fmt: skip
        log = proc.logs()
        assert "cuda_graph = False  (cli)" in log and "gpu_memory_utilization = 0.5  (cli)" in log
        # What each vLLM flag was taken as (docs/vllm_flags.md), in the start-up log.
        assert "vLLM flag --enforce-eager: CUDA graphs off (--no-cuda-graph)" in log
        assert "trust_remote_code = True  (cli)" in log  # an option of ours now, vLLM's name
        assert "vLLM flag --disable-log-stats: accepted" in log
        assert "loading weights: shard 1/1 (model.safetensors)" in log
        assert "request cmpl-" not in log and '"POST /v1/completions' not in log
    finally:
        assert proc.stop() == 0


def test_requests_and_access_are_logged_by_default(server) -> None:
    server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    log = server.logs()
    assert "request cmpl-" in log and '"POST /v1/completions HTTP/1.1" 200' in log


def test_options_from_file_env_and_cli_reach_the_server(model_dir, tmp_path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {model_dir}\nserved_model_name: from-file\nmax_model_len: 128\nmax_queue: 3\n"
    )
    env = {"MLASERVE_CONFIG": str(config), "MLASERVE_SERVED_MODEL_NAME": "from-env"}
    proc = start_server(None, tmp_path / "server.log", "--max-queue", "5", env=env)
    try:
        proc.wait_ready()
        model = proc.get("/v1/models").json()["data"][0]
        assert model["id"] == "from-env" and model["max_model_len"] == 128
        log = proc.logs()
        assert "served_model_name = 'from-env'  (env MLASERVE_SERVED_MODEL_NAME)" in log
        assert f"max_model_len = 128  (file {config})" in log
        assert "max_queue = 5  (cli)" in log
    finally:
        assert proc.stop() == 0


@pytest.mark.skipif(
    not (default_model_path() / "config.json").is_file(), reason="default model not shipped yet"
)
def test_without_model_it_serves_the_shipped_default(tmp_path) -> None:
    proc = start_server(None, tmp_path / "server.log", "--max-model-len", "256")
    try:
        proc.wait_ready()
        model = proc.get("/v1/models").json()["data"][0]
        assert model["root"] == str(default_model_path())
        out = proc.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 8})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1
    finally:
        assert proc.stop() == 0
