"""bench/startup.py on the CPU, end to end: `mlaserve precompile` then `mlaserve serve` on one
fresh cache folder, the row's phases read from /metrics and the compile counts from the logs
(0 on the CPU: nothing of the project's compiles here); and its parsers on fixed text."""

from __future__ import annotations

import json

import pytest

from bench.startup import main, parse_cache_loads, parse_compiles, parse_phases


def test_parsers() -> None:
    text = (
        "# TYPE mlaserve:startup_duration_seconds gauge\n"
        'mlaserve:startup_duration_seconds{model_name="m",phase="weight_read"} 0.5\n'
        'mlaserve:startup_duration_seconds{model_name="m",phase="other"} 0.25\n'
    )
    assert parse_phases(text) == {"weight_read": 0.5, "other": 0.25}
    log = "x INFO: compile watch: 122 JIT compilations during start-up (torch.compile, triton)"
    assert parse_compiles(log) == 122 and parse_compiles("nothing") is None
    assert parse_cache_loads(log + "; 7 kernels loaded from the on-disk cache") == 7


def test_precompiled_scenario_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenario", "precompiled", "--", "--device", "cpu", "--max-num-seqs", "4"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]  # fmt: skip
    assert [r["run"] for r in rows] == ["precompile", "served"]
    assert rows[0]["compiles"] == 0 and rows[1]["compiles"] == 0
    served = rows[1]
    assert served["ready_s"] > 0 and {"weight_read", "warmup", "other"} <= set(served["phases"])
