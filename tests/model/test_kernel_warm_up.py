"""`warm_up_concurrently`: every call runs, on the caller's device, and a failure reaches the
caller. On the GPU the calls run on threads; the kernel variants they compile are the ones the
model's decode then uses (tests/engine's compile watch: none compiles while serving)."""

from __future__ import annotations

import threading

import pytest
import torch

from mlaserve.model.kernel_warm_up import warm_up_concurrently


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
