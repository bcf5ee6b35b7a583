"""`StartupTimes` (mlaserve/startup_times.py): named phases of the engine's start-up, none inside
another, so that they and `other` sum to the process's age at ready; and a real engine's start
filling every phase that runs on the CPU (its /metrics gauge: tests/service/test_startup_metrics.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from mlaserve.config import EngineConfig
from mlaserve.startup_times import PHASES, StartupTimes, process_age_s


def test_phases_accumulate_and_are_checked() -> None:
    times = StartupTimes()
    times.add("warmup", 1.0)
    times.add("warmup", 0.5)
    with times.phase("capture"):
        pass
    assert times.seconds()["warmup"] == 1.5 and times.seconds()["capture"] >= 0.0
    assert list(times.seconds()) == ["warmup", "capture"]  # PHASES order, only those that ran
    with pytest.raises(ValueError, match="unknown start-up phase"):
        times.add("lunch", 1.0)
    with pytest.raises(ValueError, match="negative"):
        times.add("warmup", -0.1)


def test_ready_sets_the_total_and_other_makes_up_the_rest() -> None:
    times = StartupTimes()
    assert times.phase_seconds() == {}  # nothing on /metrics before ready
    times.add("weight_read", 0.25)
    times.weight_bytes = 10**9
    times.mark_ready(num_compiles=3)
    assert times.total_s is not None and times.total_s >= 0.25
    shown = times.phase_seconds()
    assert math.isclose(sum(shown.values()), times.total_s, rel_tol=1e-9)
    assert times.weight_read_gbps == pytest.approx(4.0)
    line = times.describe()
    assert "weight read 0.25 s (1.000 GB, 4.00 GB/s)" in line and "3 JIT compilations" in line


def test_server_start_comes_before_this_process_and_adds_to_the_total() -> None:
    plain, served = StartupTimes(), StartupTimes()
    served.add("server_start", 7.0)  # the server's age when it spawned this process
    plain.mark_ready()
    served.mark_ready()
    assert plain.total_s is not None and served.total_s is not None
    assert served.total_s >= plain.total_s + 7.0 - 0.5  # the two mark_ready calls are apart
    assert served.total_s - served.seconds().get("process_start", 0.0) >= 7.0
    shown = served.phase_seconds()
    assert next(iter(shown)) == "server_start" and shown["server_start"] == 7.0
    assert math.isclose(sum(shown.values()), served.total_s, rel_tol=1e-9)
    assert "server start 7.00 s" in served.describe()


def test_process_age_is_known_on_linux() -> None:
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs Linux's /proc")
    age = process_age_s()
    assert age is not None and age > 0.0


def test_a_real_engine_start_fills_its_phases(
    checkpoint: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    from mlaserve.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(checkpoint("v3_moe")), device="cpu", dtype="float32", page_size=4,
        max_model_len=128, max_num_seqs=8,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="mlaserve.llm_engine"):
        engine = LLMEngine(config)
        engine.warmup()
    times = engine.startup
    seconds = times.seconds()
    # On the CPU: no CUDA context, no TP workers; torch came before the engine (this process).
    ran = {"process_start", "tokenizer", "model_construction", "weight_read",
           "weight_postprocess", "kernel_warmup", "kv_pool", "warmup", "capture"}  # fmt: skip
    assert set(seconds) == ran and ran <= set(PHASES)
    assert all(s >= 0.0 for s in seconds.values())
    assert times.total_s is not None and sum(seconds.values()) <= times.total_s
    assert times.weight_bytes > 0  # the checkpoint's bytes this process read
    assert times.num_compiles == engine.compile_watch.compiled
    shown = engine.get_stats().startup_seconds
    assert set(shown) == ran | {"other"}
    assert math.isclose(sum(shown.values()), times.total_s, rel_tol=1e-9)
    assert any(r.getMessage().startswith("start-up: ") and "weight read" in r.getMessage()
               for r in caplog.records)  # fmt: skip
