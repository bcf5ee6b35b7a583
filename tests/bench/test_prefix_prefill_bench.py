"""bench/prefix_prefill.py scaled down on the CPU default model: its hit requests really start
from the cached prefix (the script stops otherwise), its misses from nothing, and the table and
JSON line carry the floor of the cheaper attention form and the form the engine took, and
`--profile` breaks a hit down by op."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_prefix_prefill_bench_smoke() -> None:
    cmd = [
        sys.executable, "bench/prefix_prefill.py", "--device", "cpu", "--model", "",
        "--cached", "32", "--new", "4", "9", "--page-size", "16", "--rounds", "1",
        "--profile", "3",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any("hit ms" in line and "floor ms" in line for line in lines), done.stdout
    report = json.loads(lines[-1])
    assert report["bench"] == "prefix_prefill" and report["page_size"] == 16
    assert report["attention_path"] == "absorbed"  # the reference backend has no MHA form
    assert [row["new"] for row in report["rows"]] == [4, 9]
    for row in report["rows"]:
        assert row["cached"] == 32 and row["hit_ms"] > 0 and row["miss_ms"] > 0
        assert row["floor_ms"] == min(row["floor_mha_ms"], row["floor_absorbed_ms"])
        assert row["floor_ms"] > row["bytes_ms"] > 0 and row["form"] == "absorbed"
        assert row["kv_bytes"] > 0 and row["flops_mha"] > 0 and row["flops_absorbed"] > 0
        profile = row["profile"]  # --profile: one more hit, its costliest ops on the host
        assert profile["cached"] == 32 and profile["wall_ms"] > 0 and profile["launches"] > 0
        assert len(profile["top"]) == 3 and profile["busy_ms"] >= profile["top"][0]["ms"] > 0
    assert "profiled hit, 32 cached + 9 new" in done.stdout
