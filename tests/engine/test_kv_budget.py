"""engine/kv_budget.py: the KV pool's size per GPU. The device's memory figures are the inputs
(set through torch.cuda's two queries, so the arithmetic runs on the CPU); the ranks' agreement
runs in the TP engine tests (tests/engine/test_tp_engine.py)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.config import ConfigError, EngineConfig, ModelConfig
from mlaserve.engine import kv_budget
from mlaserve.kv_cache import MLAKVPool

GIB = 1 << 30
MODEL = ModelConfig.from_pretrained(EngineConfig().model_path)


def _pages(config: EngineConfig, *, free: int, total: int, reserved: int, at_start: int) -> int:
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    mp.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    try:
        return kv_budget.decide_num_pages(
            config, MODEL, device=torch.device("cuda", 0), num_kv_layers=10, page_size=64,
            kv_cache_dtype=torch.float8_e4m3fn, max_pages_per_seq=10**6, free_at_start=at_start,
        )  # fmt: skip
    finally:
        mp.undo()


PER_PAGE = MLAKVPool.bytes_per_page(10, 64, MODEL.kv_cache_dim, torch.float8_e4m3fn)


def test_explicit_num_pages_wins() -> None:
    assert _pages(EngineConfig(num_pages=7), free=GIB, total=80 * GIB, reserved=0, at_start=0) == 7


def test_without_a_share_the_pool_takes_its_fraction_of_free_memory() -> None:
    cfg = EngineConfig(kv_cache_memory_fraction=0.5)
    got = _pages(cfg, free=40 * GIB, total=80 * GIB, reserved=GIB, at_start=41 * GIB)
    assert got == (20 * GIB) // PER_PAGE


def test_the_share_counts_memory_used_outside_torch() -> None:
    # 80 GiB GPU, share 0.5 = 40 GiB; torch holds 10 GiB but 14 GiB of free memory went since
    # start (NCCL's buffers): 26 GiB left in the share, 0.5 of it for the pool.
    cfg = EngineConfig(gpu_memory_utilization=0.5, kv_cache_memory_fraction=0.5)
    got = _pages(cfg, free=60 * GIB, total=80 * GIB, reserved=10 * GIB, at_start=74 * GIB)
    assert got == (13 * GIB) // PER_PAGE


def test_a_share_the_weights_already_fill_is_a_config_error() -> None:
    cfg = EngineConfig(gpu_memory_utilization=0.1)
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        _pages(cfg, free=60 * GIB, total=80 * GIB, reserved=9 * GIB, at_start=69 * GIB)


def test_never_more_pages_than_the_slots_can_use() -> None:
    cfg = EngineConfig(max_num_seqs=2)
    got = kv_budget.decide_num_pages(
        cfg, MODEL, device=torch.device("cpu"), num_kv_layers=10, page_size=64,
        kv_cache_dtype=torch.float8_e4m3fn, max_pages_per_seq=3, free_at_start=0,
    )  # fmt: skip
    assert got == 2 * 3 + 1
