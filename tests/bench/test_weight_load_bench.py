"""bench/weight_load.py on the CPU: a tiny checkpoint loaded by both paths (one rank of TP2 too),
the table and the JSON line; both paths read the same bytes, a TP2 rank less than the whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.weight_load import main
from tests.checkpoints import make_checkpoint


def _row(out: str) -> dict:
    (line,) = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(line)


def test_both_paths_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = make_checkpoint(tmp_path, "v3_moe")
    assert (
        main(["--model", str(path), "--device", "cpu", "--dtype", "fp32", "--threads", "1,4"]) == 0
    )
    out = capsys.readouterr().out
    assert "page cache read" in out and "load staged (4 readers)" in out
    row = _row(out)
    assert row["h2d_pinned_gb_s"] is None and row["page_cache_gb_s"] > 0
    assert [(r["path"], r["threads"]) for r in row["loads"]] == [
        ("safe_open", 1), ("staged", 1), ("staged", 4)
    ]  # fmt: skip
    assert {r["bytes"] for r in row["loads"]} == {row["checkpoint_bytes"]}
    assert all(r["gb_s"] > 0 for r in row["loads"])

    assert main(["--model", str(path), "--device", "cpu", "--tp-size", "2", "--tp-rank", "1"]) == 0
    rank = _row(capsys.readouterr().out)
    assert 0 < rank["loads"][0]["bytes"] == rank["loads"][1]["bytes"] < row["checkpoint_bytes"]
