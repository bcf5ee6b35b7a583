"""The custom all-reduce's decisions, on the CPU (mlaserve/custom_all_reduce.py): the path by byte
size, the measured plans and their switch overrides, the reasons it stays off, the group-wide
agreement (2 gloo processes), the tensors it takes (`handles`, on the meta device: shapes and
dtypes without a GPU), and `tensor_parallel.all_reduce` falling back to the process group where
it is off. The kernels themselves run in tests/test_custom_all_reduce_gpu.py (2 GPUs)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mlaserve import custom_all_reduce as car
from mlaserve.custom_all_reduce import (
    MEASURED_PLANS,
    NCCL,
    ONE_SHOT,
    TWO_SHOT,
    AllReducePlan,
    CustomAllReduce,
    agree_on_reason,
    plan_for,
    unavailable_reason,
)
from mlaserve.tensor_parallel import TensorParallel, all_reduce
from tests.model.tp_ranks import run_on_ranks

HIDDEN = 7168  # V3's hidden size: the all-reduces of a decode step are [bs, 7168] bf16
SWITCHES = ("MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES", "MLASERVE_ALL_REDUCE_TWO_SHOT_MAX_BYTES")
CUDA_OK_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


def v3_bytes(bs: int) -> int:
    return bs * HIDDEN * 2


def test_plan_chooses_by_byte_size_at_its_bounds() -> None:
    plan = AllReducePlan(one_shot_max_bytes=1024, two_shot_max_bytes=4096)
    assert plan.max_bytes == 4096
    assert [plan.choose(n) for n in (0, 16, 1024, 1040, 4096, 4112)] == [
        NCCL, ONE_SHOT, ONE_SHOT, TWO_SHOT, TWO_SHOT, NCCL,
    ]  # fmt: skip
    two_only = AllReducePlan(0, 4096)
    assert two_only.choose(16) == TWO_SHOT and two_only.choose(8192) == NCCL
    assert AllReducePlan(0, 0).choose(16) == NCCL and AllReducePlan(0, 0).max_bytes == 0
    below = AllReducePlan(4096, 1024)  # two-shot's bound under one-shot's: never two-shot
    assert {below.choose(n) for n in (16, 1024, 4096)} == {ONE_SHOT}


@pytest.mark.parametrize("bad", [(-16, 0), (0, 1000), (8, 16)])
def test_plan_bounds_are_non_negative_multiples_of_16(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        AllReducePlan(*bad)


def test_measured_plans_follow_the_measured_tables() -> None:
    """2 GPUs (this module's paths, nvidia-h200-x2): one-shot up to bs 64, two-shot up to 256;
    4 GPUs (issue 42's table): one-shot up to bs 8, two-shot up to 256; past 3.5 MiB (bs 256 x
    7168 bf16, the largest measured) NCCL."""
    two, four = MEASURED_PLANS[2], MEASURED_PLANS[4]
    sizes = [1, 8, 32, 64, 128, 256, 257, 1024]
    assert [two.choose(v3_bytes(bs)) for bs in sizes] == (
        [ONE_SHOT] * 4 + [TWO_SHOT] * 2 + [NCCL] * 2
    )
    assert [four.choose(v3_bytes(bs)) for bs in sizes] == (
        [ONE_SHOT] * 2 + [TWO_SHOT] * 4 + [NCCL] * 2
    )
    assert two.max_bytes == four.max_bytes == v3_bytes(256)


def test_plan_for_takes_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plan_for(2) == MEASURED_PLANS[2] and plan_for(4) == MEASURED_PLANS[4]
    assert plan_for(8) == AllReducePlan(0, 0)  # not measured: NCCL only
    monkeypatch.setenv(SWITCHES[0], "100008")  # rounded down to a multiple of 16
    monkeypatch.setenv(SWITCHES[1], "0")
    assert plan_for(4) == AllReducePlan(100000, 0)
    monkeypatch.setenv(SWITCHES[1], "65536")
    assert plan_for(8) == AllReducePlan(100000, 65536)
    assert plan_for(3) == AllReducePlan(100000, 0)  # two-shot has no 3-rank kernel
    monkeypatch.setenv(SWITCHES[0], "0")
    monkeypatch.setenv(SWITCHES[1], "0")
    assert plan_for(2).max_bytes == 0


def test_reasons_it_stays_off(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, plan = torch.device("cuda", 0), MEASURED_PLANS[2]
    assert "one rank" in unavailable_reason(cuda, 1, plan, CUDA_OK_ENV)
    assert "not CUDA" in unavailable_reason(torch.device("cpu"), 2, plan, CUDA_OK_ENV)
    assert "no measured thresholds for 8 GPUs" in unavailable_reason(
        cuda, 8, plan_for(8), CUDA_OK_ENV
    )
    assert "switched off" in unavailable_reason(cuda, 2, AllReducePlan(0, 0), CUDA_OK_ENV)
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is not set" in unavailable_reason(cuda, 2, plan, {})
    assert "is not set" in unavailable_reason(
        cuda, 2, plan, {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0"}
    )
    monkeypatch.setitem(car.OPS, TWO_SHOT, "two_shot_all_reduce_not_in_this_torch")
    assert "has no torch.ops.symm_mem.two_shot_all_reduce_not_in_this_torch" in (
        unavailable_reason(cuda, 2, plan, CUDA_OK_ENV)
    )
    assert unavailable_reason(cuda, 2, AllReducePlan(1024, 0), CUDA_OK_ENV) is None  # unused op


def test_this_torch_has_the_ops_the_plans_use() -> None:
    """The ops are registered in CPU builds too: the schemas the module calls exist."""
    assert unavailable_reason(torch.device("cuda", 0), 4, MEASURED_PLANS[4], CUDA_OK_ENV) is None
    for name in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out"):
        schema = str(getattr(torch.ops.symm_mem, name).default._schema)
        assert "str reduce_op, str group_name" in schema, schema


def _agreement(tp: TensorParallel) -> tuple[str | None, str | None, object]:
    """Rank 1 alone has a reason: both ranks end with one. None on both: None. Then `create`
    on a CPU group: None on both ranks (not CUDA), agreed over gloo."""
    mine = "rank 1 cannot" if tp.rank == 1 else None
    one = agree_on_reason(mine, "a peer cannot", tp.group, torch.device("cpu"))
    none = agree_on_reason(None, "a peer cannot", tp.group, torch.device("cpu"))
    return one, none, CustomAllReduce.create(tp.group, torch.device("cpu"))


def test_ranks_agree_on_the_fallback(tmp_path: Path) -> None:
    results = run_on_ranks(_agreement, 2, tmp_path)
    assert results == [("a peer cannot", None, None), ("rank 1 cannot", None, None)]


def test_the_fallback_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mlaserve.custom_all_reduce"):
        assert car._fallback("because", 2) is None
    assert "custom all-reduce off on 2 ranks, NCCL for every size: because" in caplog.text


def meta_custom(plan: AllReducePlan) -> CustomAllReduce:
    """A CustomAllReduce on the meta device: its size and dtype rules without a GPU."""
    group = SimpleNamespace(group_name="meta")
    buffer = torch.empty(plan.max_bytes, dtype=torch.uint8, device="meta")
    return CustomAllReduce(group, torch.device("meta"), plan, buffer)


def test_handles_decode_sizes_in_bf16_and_fp32_only() -> None:
    custom = meta_custom(MEASURED_PLANS[4])
    meta = {"device": "meta"}
    assert custom.handles(torch.empty(1, HIDDEN, dtype=torch.bfloat16, **meta))
    assert custom.handles(torch.empty(256, HIDDEN, dtype=torch.bfloat16, **meta))
    assert custom.handles(torch.empty(128, HIDDEN, dtype=torch.float32, **meta))
    assert not custom.handles(torch.empty(257, HIDDEN, dtype=torch.bfloat16, **meta))  # > 3.5 MiB
    assert not custom.handles(torch.empty(1, HIDDEN, dtype=torch.float16, **meta))  # no kernel
    assert not custom.handles(torch.empty(3, 5, dtype=torch.bfloat16, **meta))  # 30 bytes
    assert not custom.handles(torch.empty(0, HIDDEN, dtype=torch.bfloat16, **meta))
    assert not custom.handles(torch.empty(1, HIDDEN, dtype=torch.bfloat16))  # another device
    with pytest.raises(ValueError, match="cannot take 30 bytes"):
        custom.all_reduce(torch.empty(3, 5, dtype=torch.bfloat16, **meta), ONE_SHOT)
    with pytest.raises(ValueError, match="nccl cannot take"):
        custom.all_reduce(torch.empty(257, HIDDEN, dtype=torch.bfloat16, **meta))
    custom.close()
    assert not custom.handles(torch.empty(1, HIDDEN, dtype=torch.bfloat16, **meta))
    with pytest.raises(RuntimeError, match="after close"):
        custom.all_reduce(torch.empty(1, HIDDEN, dtype=torch.bfloat16, **meta))


def _sum_with_custom_off(tp: TensorParallel) -> torch.Tensor:
    """A TensorParallel holding a custom all-reduce (meta device) with a CPU tensor: the
    custom one declines it and gloo sums it."""
    with_custom = TensorParallel(tp.rank, tp.size, tp.group, meta_custom(MEASURED_PLANS[2]))
    return all_reduce(torch.full((2, 8), float(tp.rank + 1)), with_custom)


def test_tensors_it_declines_go_to_the_process_group(tmp_path: Path) -> None:
    for result in run_on_ranks(_sum_with_custom_off, 2, tmp_path):
        assert torch.equal(result, torch.full((2, 8), 3.0))
