"""bench/prefix_cache.py scaled down on the CPU default model: both modes, the three workloads,
the table and a JSON line whose cache-on run hits and whose cache-off run does not, and a steady
decode window in both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_prefix_cache_bench_smoke() -> None:
    cmd = [
        sys.executable, "bench/prefix_cache.py", "--device", "cpu", "--users", "3",
        "--system-tokens", "40", "--question-tokens", "6", "--turns", "2", "--turn-tokens",
        "12", "--max-tokens", "3", "--concurrency", "3", "--decode-tokens", "12",
        "--startup-timeout-s", "180",
        "--timeout-s", "180", "--", "--page-size", "16", "--max-model-len", "256",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any("TTFT p50" in line for line in lines), done.stdout
    report = json.loads(lines[-1])
    for workload in ("shared", "chat"):
        assert report["off"][workload]["hit_rate"] == 0.0
        assert report["on"][workload]["hit_rate"] > 0.0
        assert report["on"][workload]["requests"] == report["off"][workload]["requests"]
        assert report["on"][workload]["output_tok_s"] > 0
    # All users decode at once for most of their 12 tokens: a steady window in both modes.
    for mode in ("off", "on"):
        assert report[mode]["decode"]["steady_tpot_ms"] > 0, report[mode]["decode"]
    assert report["on"]["decode"]["hit_rate"] > 0.0
    assert any("steady TPOT at batch 3" in line for line in lines), done.stdout


def test_prefix_cache_bench_refuses_an_unknown_workload() -> None:
    cmd = [sys.executable, "bench/prefix_cache.py", "--workloads", "shared,bogus"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--workloads: unknown or disabled ['bogus']" in done.stderr
