"""GPU-only options set on a CPU engine are named in the log, not silently dropped (issue 45)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mlaserve.config import EngineConfig
from mlaserve.engine.gpu_only_options import GPU_ONLY_ENV, GPU_ONLY_FIELDS, ignored_gpu_options

CPU = torch.device("cpu")
SET = {
    "gpu_memory_utilization": 0.5,
    "kv_cache_memory_fraction": 0.5,
    "cuda_graph_batch_sizes": (1, 2),
    "piecewise_cuda_graph_max_tokens": 64,
}


def test_every_gpu_only_field_is_named_once_when_set() -> None:
    assert set(SET) == set(GPU_ONLY_FIELDS)  # a new GPU-only field gets a case here
    lines = ignored_gpu_options(EngineConfig(device="cpu", **SET), CPU, environ={})
    assert len(lines) == len(SET)
    for name, line in zip(SET, lines, strict=True):
        assert line.startswith("--" + name.replace("_", "-") + " ")
        assert "no effect on device cpu" in line
    assert "--num-pages" in lines[0]  # what sizes the CPU's KV pool instead


def test_defaults_name_nothing_and_cuda_reads_them_all() -> None:
    assert ignored_gpu_options(EngineConfig(device="cpu"), CPU, environ={}) == []
    env = dict.fromkeys(GPU_ONLY_ENV, "4096")
    config = EngineConfig(device="cpu", **SET)
    assert ignored_gpu_options(config, torch.device("cuda", 0), environ=env) == []


def test_the_custom_all_reduce_switches_are_named_when_set() -> None:
    env = {"MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES": "0", "PATH": "/bin"}
    (line,) = ignored_gpu_options(EngineConfig(device="cpu"), CPU, environ=env)
    assert line.startswith("MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES=0 has no effect on device cpu")


def test_a_cpu_engine_logs_each_one(
    checkpoint: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    from mlaserve.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(checkpoint("v3_moe")), device="cpu", dtype="float32", page_size=4,
        max_model_len=128, max_num_seqs=8, gpu_memory_utilization=0.6,
        cuda_graph_batch_sizes=(1, 2, 4),
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="mlaserve.llm_engine"):
        engine = LLMEngine(config)
    try:
        named = [r for r in caplog.records if "no effect on device cpu" in r.getMessage()]
        assert [r.getMessage().split(" ", 1)[0] for r in named] == [
            "--gpu-memory-utilization",
            "--cuda-graph-batch-sizes",
        ]
        assert {r.levelno for r in named} == {logging.WARNING}
    finally:
        engine.shutdown()
