"""`mlaserve serve` as an operator runs it: help, exit codes, and options from every source."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlaserve.config import default_model_path
from mlaserve.service.settings import options
from tests.service.server_process import REPO_ROOT, start_server


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


def test_a_bad_option_exits_2_naming_it() -> None:
    done = _run("serve", "--page-size", "3")
    assert done.returncode == 2
    assert "page_size" in done.stderr and "(cli)" in done.stderr
    assert _run("serve", "--no-such-option", "1").returncode == 2


def test_a_model_that_cannot_load_exits_1(tmp_path) -> None:
    proc = start_server(tmp_path / "no-model-here", tmp_path / "server.log")
    assert proc.proc.wait(60) == 1
    assert "config.json" in proc.logs()


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
