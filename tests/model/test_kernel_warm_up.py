"""`warm_up_concurrently` and `KernelWarmUp`: every task runs, on the caller's device, and a
failure reaches the caller. On the GPU the tasks run on threads, in the background until
`join`; the kernel variants they compile are the ones the model's decode then uses (tests/engine's
compile watch: none compiles while serving)."""

from __future__ import annotations

import threading

import pytest
import torch

from mlaserve.model.kernel_warm_up import KernelWarmUp, warm_up_concurrently


def test_cpu_runs_every_call_in_order_here() -> None:
    seen = []
    calls = [lambda i=i: seen.append((i, threading.get_ident())) for i in range(5)]
    warm_up_concurrently(calls, torch.device("cpu"))
    assert seen == [(i, threading.get_ident()) for i in range(5)]


def test_cpu_failure_is_raised() -> None:
    def broken() -> None:
        raise ValueError("no such variant")

    with pytest.raises(ValueError, match="no such variant"):
        warm_up_concurrently([lambda: None, broken], torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_calls_run_on_threads_on_the_callers_device() -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # not device 0 where there are two
    seen, results = [], {}

    def call(i: int) -> None:
        seen.append((threading.get_ident(), torch.cuda.current_device()))
        assert not torch.is_grad_enabled()  # the caller's mode, below
        x = torch.full((64,), float(i), device=device)
        results[i] = float((x * 2).sum())

    with torch.no_grad():
        warm_up_concurrently([lambda i=i: call(i) for i in range(8)], device)
    assert {dev for _, dev in seen} == {device.index}
    assert threading.get_ident() not in {tid for tid, _ in seen}
    assert results == {i: 128.0 * i for i in range(8)}

    seen.clear()
    with torch.no_grad():
        warm_up_concurrently([lambda i=i: call(i) for i in range(3)], device, in_order=True)
    assert [tid for tid, _ in seen] == [threading.get_ident()] * 3  # here, in order

    def broken() -> None:
        raise RuntimeError("variant failed")

    with pytest.raises(RuntimeError, match="variant failed"):
        warm_up_concurrently([lambda: None, broken], device)


def test_background_warm_up_needs_a_gpu() -> None:
    with pytest.raises(ValueError, match="a CUDA device"):
        KernelWarmUp.start([lambda: None], torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_background_tasks_run_while_the_caller_goes_on_until_join() -> None:
    """The tasks wait for an event only the caller sets after `start` returned: they can finish
    only if the caller went on while they ran. `join` re-raises a task's failure once every
    task has ended, and refuses a second call."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    go, done = threading.Event(), []

    def task(i: int) -> None:
        assert go.wait(timeout=60)
        done.append((i, torch.cuda.current_device(), float(torch.ones(4, device=device).sum())))

    warm_up = KernelWarmUp.start([lambda i=i: task(i) for i in range(6)], device)
    assert not warm_up.joined and done == []
    go.set()
    warm_up.join()
    assert warm_up.joined
    assert sorted(done) == [(i, device.index, 4.0) for i in range(6)]
    assert warm_up.busy_s > 0
    with pytest.raises(RuntimeError, match="joined twice"):
        warm_up.join()

    ended = []

    def slow() -> None:
        threading.Event().wait(0.2)
        ended.append(True)

    def broken() -> None:
        raise RuntimeError("variant failed")

    warm_up = KernelWarmUp.start([broken, slow], device)
    with pytest.raises(RuntimeError, match="variant failed"):
        warm_up.join()
    assert ended == [True]  # the failure was raised after every task ended


def test_layer_tasks_run_each_decoder_layer_kind_once_per_token_count(monkeypatch) -> None:
    """`layer_warm_up_tasks`: one task per (token count, decoder-layer kind), the kinds being
    the layers of distinct FFN and parameter shapes (the default model: its dense first layer
    and its MoE layers, the MTP layer one of them), each running that layer's `warm_up` at
    the count, here on the CPU."""
    from mlaserve.config import ModelConfig, default_model_path
    from mlaserve.model import load_model
    from mlaserve.model.layers.decoder_layer import DeepseekDecoderLayer

    config = ModelConfig.from_pretrained(default_model_path())
    model = load_model(config, default_model_path(), dtype=torch.bfloat16)
    ran = []
    real = DeepseekDecoderLayer.warm_up

    def record(layer, num_tokens, act_dtype):
        ran.append((type(layer.mlp).__name__, num_tokens, act_dtype))
        real(layer, num_tokens, act_dtype)

    monkeypatch.setattr(DeepseekDecoderLayer, "warm_up", record)
    tasks = model.layer_warm_up_tasks([1, 24])
    for task in tasks:
        task()
    layers = [m for m in model.modules() if isinstance(m, DeepseekDecoderLayer)]
    assert len(layers) > 2  # several MoE layers, warmed once
    kinds = sorted({type(m.mlp).__name__ for m in layers})
    assert kinds == ["DeepseekMLP", "DeepseekMoE"]
    expected = {(kind, n, torch.bfloat16) for kind in kinds for n in (1, 24)}
    assert len(ran) == len(tasks) == len(expected) and set(ran) == expected


# A fresh interpreter (Triton's in-memory kernels are per process: in this one earlier tests
# built them): the engine built, its background warm-up joined before anything else runs, then
# start-up's forwards (the throwaway request, the graphs' eager runs and captures, the MTP
# draft's and the step-cost measurement) with a hook on every Triton kernel built from then on.
# The hook fires whether the kernel compiles or loads from the on-disk cache, so a filled cache
# proves the same as an empty one.
_COVERAGE = r"""
import json, sys
from triton import knobs
from mlaserve.config import EngineConfig
from mlaserve.llm_engine import LLMEngine

engine = LLMEngine(EngineConfig(device="cuda", **json.loads(sys.argv[1])))
engine.runner.join_kernel_warm_up()
built = []
knobs.runtime.jit_post_compile_hook = lambda *a, **k: built.append(str(k.get("repr")))
engine.warmup()
print("BUILT " + json.dumps(built))
print("PROCESS_COMPILES " + str(engine.runner.process_compiles))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("options", "empty_cache"),
    [
        ({}, False),
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}, False),
        ({}, True),
    ],
    ids=["default", "mtp3", "default-empty-cache"],
)
def test_gpu_warm_up_tasks_build_every_kernel_start_up_runs(options, empty_cache, tmp_path) -> None:
    """Every Triton kernel variant start-up's forwards take is one a warm-up task built: after
    the join, the engine's warm-up builds none. A variant left out would compile on the
    start-up's main thread, one at a time, instead of beside it (issue 44's cold start). On an
    empty cache the variants compile on worker processes first (`kernel_compile_pool.py`)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    if empty_cache:
        env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    proc = subprocess.run(
        [sys.executable, "-c", _COVERAGE, json.dumps(options)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BUILT "))
    built = json.loads(line.removeprefix("BUILT "))
    assert built == [], "built after the join:\n" + "\n".join(built)
    if empty_cache:  # the default model has ~124 variants
        line = next(x for x in proc.stdout.splitlines() if x.startswith("PROCESS_COMPILES "))
        assert int(line.removeprefix("PROCESS_COMPILES ")) > 50
