"""The tensor-parallel benchmarks' own arithmetic, on the CPU (bench/all_reduce.py,
bench/tp_decode.py; their GPU runs are the lead's): the plan a run's timings imply, on issue
42's timings, is the one mlaserve ships; the 61-layer extrapolation recovers a linear model;
the V3-width config the decode bench writes parses as V3 with FP8 blocks and splits over 2 and
4 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.all_reduce import implied_plan
from bench.tp_decode import (
    V3_LAYERS,
    V3_WIDTH,
    count_all_reduces,
    extrapolate,
    fit_holds,
    rank_shapes_of,
    write_model,
)
from mlaserve.config import ModelConfig
from mlaserve.custom_all_reduce import MEASURED_PLANS
from mlaserve.tensor_parallel import TensorParallel

# The timings the shipped plans come from (us per call in a graph of 50): bs -> (NCCL, 1-shot,
# 2-shot). 4 GPUs: issue 42's table (nvidia-h200-x4); 2 GPUs: bench/all_reduce.py --gpus 2
# through this module's paths (nvidia-h200-x2, 2026-11-28).
ISSUE_42 = {
    2: {1: (12.4, 7.6, 11.0), 8: (11.8, 8.7, 13.1), 32: (15.1, 12.0, 13.7), 64: (18.8, 15.2, 17.0),
        128: (34.6, 20.7, 19.4), 256: (37.5, 32.1, 25.2)},
    4: {1: (16.6, 7.4, 7.0), 8: (15.9, 8.9, 9.6), 32: (19.6, 13.1, 9.4), 64: (23.4, 16.9, 12.1),
        256: (44.1, 43.6, 26.3)},
}  # fmt: skip


@pytest.mark.parametrize("gpus", sorted(ISSUE_42))
def test_the_shipped_plans_are_what_the_issue_42_timings_imply(gpus: int) -> None:
    rows = [
        {"bytes": bs * 7168 * 2, "nccl_us": n, "one_shot_us": one, "two_shot_us": two,
         "best_us": min(n, one, two)}
        for bs, (n, one, two) in ISSUE_42[gpus].items()
    ]  # fmt: skip
    plan = implied_plan(rows)
    assert plan == {
        "one_shot_max_bytes": MEASURED_PLANS[gpus].one_shot_max_bytes,
        "two_shot_max_bytes": MEASURED_PLANS[gpus].two_shot_max_bytes,
    }


def test_implied_plan_without_a_custom_win_is_nccl_only() -> None:
    rows = [{"bytes": 16 << k, "nccl_us": 5.0, "one_shot_us": 6.0, "two_shot_us": 7.0,
             "best_us": 5.0} for k in range(4)]  # fmt: skip
    assert implied_plan(rows) == {"one_shot_max_bytes": 0, "two_shot_max_bytes": 0}


def test_extrapolation_recovers_a_linear_model() -> None:
    fixed, per_layer = 1.5, 0.25  # ms

    def depth(layers: int) -> dict:
        return {"layers": layers, "rows": [{"bs": 1, "step_ms": fixed + layers * per_layer},
                                           {"bs": 8, "step_ms": 99.0}]}  # fmt: skip

    got = extrapolate(depth(8), depth(2), "step_ms")
    assert got["per_layer_ms"] == pytest.approx(per_layer)
    assert got["fixed_ms"] == pytest.approx(fixed)
    assert got["v3_ms"] == pytest.approx(fixed + V3_LAYERS * per_layer)


def test_a_fit_whose_layer_costs_less_than_its_floor_does_not_hold() -> None:
    """Call A of the thirty-eighth session: a TP8 rank's 2-layer step (0.82 ms, host-bound) was
    longer than its 8-layer one (0.78): the slope is not a layer's cost."""

    def depth(layers: int, step: float, floor: float) -> dict:
        return {"layers": layers, "rows": [{"bs": 1, "step_ms": step, "floor_ms": floor}]}

    deep, shallow = depth(8, 0.780, 0.347), depth(2, 0.82, 0.131)
    assert not fit_holds(
        extrapolate(deep, shallow, "step_ms"), extrapolate(deep, shallow, "floor_ms")
    )
    deep, shallow = depth(8, 1.41, 0.94), depth(2, 0.72, 0.29)  # TP2-like: 0.115 vs 0.108 a layer
    assert fit_holds(extrapolate(deep, shallow, "step_ms"), extrapolate(deep, shallow, "floor_ms"))


def test_the_v3_width_config_parses_and_splits(tmp_path: Path) -> None:
    mc = ModelConfig.from_pretrained(write_model(tmp_path, 8))
    assert (mc.hidden_size, mc.num_attention_heads, mc.q_lora_rank, mc.kv_lora_rank) == (
        7168, 128, 1536, 512,
    )  # fmt: skip
    assert (mc.n_routed_experts, mc.num_experts_per_tok, mc.n_shared_experts) == (256, 8, 1)
    assert (mc.moe_intermediate_size, mc.intermediate_size, mc.vocab_size) == (2048, 18432, 129280)
    assert mc.num_hidden_layers == 8 and mc.is_moe_layer(1) and not mc.is_moe_layer(0)
    assert mc.quantization is not None and mc.quantization.weight_block_size == (128, 128)
    for n in (2, 4):
        tp = TensorParallel(0, n)
        assert tp.split(mc.num_attention_heads, "heads") == 128 // n
        assert tp.split(mc.moe_intermediate_size, "moe_intermediate") % 128 == 0  # FP8 blocks
        assert tp.split(mc.intermediate_size, "intermediate") % 128 == 0
        assert (tp.split(mc.num_attention_heads, "heads") * mc.v_head_dim) % 128 == 0  # o_proj


def test_the_k2_width_config_parses_as_kimi_k2_and_splits_over_8(tmp_path: Path) -> None:
    mc = ModelConfig.from_pretrained(write_model(tmp_path, 8, "k2"))
    assert mc.model_type == "kimi_k2" and mc.scoring_func == "sigmoid"
    assert (mc.num_attention_heads, mc.n_routed_experts, mc.n_group, mc.vocab_size) == (
        64, 384, 1, 163840,
    )  # fmt: skip
    for n in (2, 4, 8):
        tp = TensorParallel(0, n)
        assert (tp.split(mc.num_attention_heads, "heads") * mc.v_head_dim) % 128 == 0  # o_proj
        assert tp.split(mc.moe_intermediate_size, "moe_intermediate") % 128 == 0
        assert mc.n_routed_experts % n == 0  # expert parallel takes whole experts


@pytest.mark.parametrize(
    ("arch", "tp", "of"), [("v3", 2, 4), ("v3", 2, 8), ("k2", 2, 8), ("v3", 1, 8)]
)
def test_rank_shapes_of_a_larger_tp_give_each_rank_that_tps_shapes(
    tmp_path: Path, arch: str, tp: int, of: int
) -> None:
    """A rank of TP `tp` on the scaled config holds what a rank of TP `of` holds on the real one:
    heads, dense and expert intermediate slices, vocabulary rows; replicated widths unchanged."""
    real = ModelConfig.from_pretrained(write_model(tmp_path / "real", 8, arch))
    scaled = ModelConfig.from_pretrained(write_model(tmp_path / "scaled", 8, arch, (tp, of)))
    small, big = TensorParallel(0, tp), TensorParallel(0, of)
    for name in ("num_attention_heads", "intermediate_size", "moe_intermediate_size", "vocab_size"):
        assert small.split(getattr(scaled, name), name) == big.split(getattr(real, name), name)
    for name in (
        "hidden_size",
        "q_lora_rank",
        "kv_lora_rank",
        "n_routed_experts",
        "num_experts_per_tok",
    ):
        assert getattr(scaled, name) == getattr(real, name)
    assert scaled.quantization == real.quantization


def test_rank_shapes_of_refuses_what_does_not_split() -> None:
    with pytest.raises(ValueError, match="multiple of 2"):
        rank_shapes_of(V3_WIDTH, 2, 3)
    with pytest.raises(ValueError, match="num_attention_heads 128 does not split over 256"):
        rank_shapes_of(V3_WIDTH, 2, 256)


def test_tp_agreement_runs_each_variant_in_its_own_process_on_the_cpu() -> None:
    """bench/tp_agreement.py end to end over gloo: TP1, TP2, TP2 eager and TP2 with MTP, each in
    a fresh process; on the CPU every variant equals its reference token for token."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "bench" / "tp_agreement.py"), "--device", "cpu", "--tp", "2",
         "--prompts", "2", "--max-tokens", "4", "--num-pages", "256", "--dtype", "float32"],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["dtype"] == "float32"
    rows = {(r["variant"], r["reference"]): r for r in report["rows"]}
    assert set(rows) == {("tp2", "tp1"), ("tp2_eager", "tp2"), ("tp2_mtp2", "tp2")}
    assert all(r["identical"] == r["of"] == 2 for r in rows.values()), rows


def test_tp_agreement_in_the_deterministic_mode_is_bitwise_on_the_cpu() -> None:
    """bench/tp_agreement.py --deterministic in bf16 over gloo: TP2's first-step logits equal
    TP1's bit for bit (max |d| 0) and every variant equals its reference token for token."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "bench" / "tp_agreement.py"), "--device", "cpu", "--tp", "2",
         "--prompts", "2", "--max-tokens", "4", "--num-pages", "256", "--dtype", "bfloat16",
         "--deterministic", "--prompt-words", "5", "30"],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["deterministic"] and report["prompt_words"] == [5, 30]
    rows = {(r["variant"], r["reference"]): r for r in report["rows"]}
    assert all(r["identical"] == r["of"] == 2 for r in rows.values()), rows
    assert rows[("tp2", "tp1")]["first_logits_max_abs_diff"] == 0.0


def test_a_steps_all_reduces_are_counted_by_kernel_name() -> None:
    """NCCL's AllReduce kernels and symmetric memory's one-shot / two-shot kernels count; its
    broadcast, all-gather and everything else do not (names as torch.profiler reports them)."""
    names = [
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(...)",
        "void (anonymous namespace)::two_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(...)",
        "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "_gate_up_kernel",
    ]
    assert count_all_reduces([(n, 1.0, 1.0) for n in names]) == 3


def test_kernel_spans_count_what_each_kernel_adds_past_the_earlier_ends() -> None:
    """bench/decode.py's accounting, on a made-up trace: kernels in start order, memcpy / memset
    and host events left out, each kernel's "adds" its end past every earlier kernel's end."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.decode import kernel_spans

    def event(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, device_time=end - start,
                               time_range=SimpleNamespace(start=start, end=end))  # fmt: skip

    trace = SimpleNamespace(events=lambda: [
        event("b", 5.0, 12.0),  # overlaps a (PDL): adds only past a's end
        event("a", 0.0, 10.0),
        event("Memcpy HtoD", 12.0, 30.0),
        event("c", 13.0, 20.0),
        event("host op", 0.0, 50.0, DeviceType.CPU),
    ])  # fmt: skip
    assert kernel_spans(trace) == [("a", 10.0, 0.0), ("b", 7.0, 2.0), ("c", 7.0, 8.0)]


def test_kernel_sequence_orders_operations_and_their_gaps(capsys) -> None:
    """`decode.kernel_sequence`: a trace's CUDA operations by start, copies included, each with
    its start after the first, its duration and the gap to the latest end before it (negative
    under a PDL overlap); the host's events are left out. `print_kernel_sequence` prints the
    first K."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.decode import kernel_sequence, print_kernel_sequence

    def event(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(start=start, end=end))  # fmt: skip

    trace = SimpleNamespace(events=lambda: [
        event("gemm", 20.0, 30.0), event("Memcpy HtoD", 10.0, 12.0), event("norm", 31.0, 33.0),
        event("pdl_next", 32.0, 40.0), event("aten::mm", 0.0, 50.0, DeviceType.CPU),
    ])  # fmt: skip
    seq = kernel_sequence(trace)
    assert [(s, d, g, n) for s, d, g, n in seq] == [
        (0.0, 2.0, 0.0, "Memcpy HtoD"), (10.0, 10.0, 8.0, "gemm"), (21.0, 2.0, 1.0, "norm"),
        (22.0, 8.0, -1.0, "pdl_next"),
    ]  # fmt: skip
    print_kernel_sequence(seq, 2)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "gemm" in lines[2] and "norm" not in "".join(lines)
