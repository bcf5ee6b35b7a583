"""`mlaserve precompile [MODEL] [engine options]`: the engine built as `serve` builds it, warmed
up, and the report (cache folder, compile count, start-up phases) on stdout, exit 0; the same
errors as `serve` before anything loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from mlaserve.jit_cache import JitCache
from mlaserve.service.settings import ServerConfig, options
from tests.service.server_process import REPO_ROOT


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLASERVE_")}
    full_env.update(env or {})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        [sys.executable, "-m", "mlaserve", "precompile", *args],
        cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_help_documents_every_engine_option_and_no_listening_ones() -> None:
    done = _run("--help")
    assert done.returncode == 0
    for opt in options():
        if opt.target is ServerConfig and opt.name not in ("log_level", "torch_threads"):
            assert opt.flag not in done.stdout, opt.flag
        else:
            assert opt.flag in done.stdout and opt.env in done.stdout, opt.flag
    assert "--cache-dir" in done.stdout and "init container" in done.stdout


def test_precompile_warms_up_and_reports_the_cache(tmp_path: Path) -> None:
    cache_dir = tmp_path / "jit"
    clean = {name: "" for name in JitCache(cache_dir).variables()}
    done = _run("--device", "cpu", "--max-num-seqs", "4", env={
        **clean, "MLASERVE_CACHE_DIR": str(cache_dir),  # the image's way of giving it
    })  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mlaserve precompile: done" in done.stdout
    assert f"cache: {cache_dir}" in done.stdout
    # Nothing of the project's compiles on the CPU (Triton's interpreter, no torch.compile).
    assert "JIT compilations during warm-up: 0" in done.stdout
    assert re.search(r"start-up: [\d.]+ s to ready: .*weight read .*warm-up [\d.]+ s", done.stdout)
    assert (cache_dir / "triton").is_dir() and (cache_dir / "cute_dsl").is_dir()


def test_a_bad_model_is_exit_2_with_one_line() -> None:
    done = _run("/no/such/checkpoint")
    assert done.returncode == 2
    assert done.stderr.startswith("mlaserve: error: model:") and "Traceback" not in done.stderr
