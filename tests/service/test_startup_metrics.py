"""A real `mlaserve serve --cache-dir DIR`: /metrics carries the start-up phases
(`mlaserve:startup_duration_seconds{phase=...}`, set once the engine is ready), the log names the
cache folder and the warm-up's compile count, and the engine process was started with every
cache variable pointing under DIR (its /proc/PID/environ: what it had before importing
anything)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mlaserve.jit_cache import JitCache
from tests.service.server_process import start_server

FAMILY = "mlaserve:startup_duration_seconds"
# On the CPU: no CUDA context and no TP workers; the engine process imports torch itself, and
# server_start is the server's time before it spawned the engine process.
CPU_PHASES = {"server_start", "process_start", "torch_import", "tokenizer", "model_construction",
              "weight_read", "weight_postprocess", "kernel_warmup", "kv_pool", "warmup", "capture",
              "other"}  # fmt: skip


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")
def test_startup_phases_on_metrics_and_the_cache_in_the_engine(tmp_path: Path) -> None:
    cache_dir = tmp_path / "jit"
    clean = {name: "" for name in JitCache(cache_dir).variables()}  # unset for the server
    server = start_server(None, tmp_path / "server.log", "--cache-dir", str(cache_dir), env=clean)
    try:
        server.wait_ready()
        samples = {}
        for line in server.get("/metrics").text.splitlines():
            m = re.match(rf'^{FAMILY}\{{model_name="[^"]*",phase="(\w+)"\}} (\S+)$', line)
            if m:
                samples[m.group(1)] = float(m.group(2))
        assert set(samples) == CPU_PHASES, samples
        assert all(s >= 0.0 for s in samples.values())
        assert samples["weight_read"] > 0.0 and samples["warmup"] > 0.0
        assert samples["server_start"] > 0.0  # the server's interpreter start, at least

        engines = [pid for pid in _children(server.proc.pid) if "spawn_main" in _cmd(pid)]
        assert len(engines) == 1, engines
        environ = _environ_of(engines[0])
        for name, value in JitCache(cache_dir).variables().items():
            assert environ.get(name) == value, name
        logs = server.logs()
        assert f"JIT cache: {cache_dir}" in logs
        assert re.search(r"start-up: [\d.]+ s to ready: server start [\d.]+ s, .*; \d+ JIT "
                         r"compilations", logs), logs  # fmt: skip
        assert re.search(r"engine process started \(pid \d+\), [\d.]+ s after the server", logs)
    finally:
        assert server.stop() == 0


def _cmd(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
