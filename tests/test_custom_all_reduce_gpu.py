"""The custom all-reduce on 2 GPUs (mlaserve/custom_all_reduce.py) against NCCL, outside and
inside a CUDA graph: 2 spawned processes on cuda:0 / cuda:1 in an NCCL group, NVLink multicast
off (tp_worker.MULTICAST_OFF), each joined through `init_tensor_parallel` as the engine's ranks
are, so `tp.custom` is the production one (2 GPUs: two-shot up to 3.5 MiB).

Cases: V3's decode all-reduce [bs, 7168] at bs 1, 8, 64, 256 and V3-lite's [3, 2048], in bf16
and fp32; each through one-shot and two-shot forced (a second CustomAllReduce whose plan takes
every size both ways) and through `tensor_parallel.all_reduce` (the plan's choice).

Checks: integer-valued inputs in [-16, 16] sum exactly in bf16 and fp32 whatever the order, so
every path must equal NCCL's result bitwise, eagerly and in a graph replayed on two different
inputs copied into the captured one (the graph reads its input's address, not its values);
normal inputs within bf16 / fp32 rounding of NCCL (the sum order differs: one-shot and two-shot
add the ranks in rank order, NCCL in its ring's): |diff| <= 2 ulps of the result's magnitude.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

HIDDEN = 7168
SHAPES = [(1, HIDDEN), (8, HIDDEN), (64, HIDDEN), (256, HIDDEN), (3, 2048)]
# |custom - NCCL| on normal inputs (2 ranks: one addition each, in another order): a rounding
# of the result at most, 2 ulps of |NCCL's| for margin. ulp = eps * magnitude.
ULPS = 2.0
TIMEOUT_S = 240.0


def _rank_main(fn: Callable[..., Any], rank: int, size: int, workdir: str) -> None:
    from mlaserve.engine.tp_worker import MULTICAST_OFF
    from mlaserve.tensor_parallel import destroy_tensor_parallel, init_tensor_parallel

    os.environ.update(MULTICAST_OFF)
    out, tp = Path(workdir), None
    try:
        torch.cuda.set_device(rank)
        tp = init_tensor_parallel(
            rank, size, backend="nccl", init_method=f"file://{out / 'store'}", timeout_s=60.0
        )
        torch.save(fn(tp), out / f"rank{rank}.pt")
        torch.distributed.barrier()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if tp is not None:
            destroy_tensor_parallel(tp)


def run_on_gpus(fn: Callable[..., Any], size: int, workdir: Path) -> list[Any]:
    """`fn(tp)` on `size` spawned processes, rank r on cuda:r over NCCL; results in rank order.
    A failed rank gets the others killed at once (they would wait in a collective)."""
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, size, str(workdir)), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        running = list(procs)
        while running and time.monotonic() < deadline and not any(p.exitcode for p in procs):
            wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
            running = [p for p in running if p.exitcode is None]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    errors = [(workdir / f"rank{r}.err") for r in range(size)]
    if any(e.exists() for e in errors):
        raise RuntimeError("\n".join(e.read_text() for e in errors if e.exists()))
    codes = [p.exitcode for p in procs]
    if any(code != 0 for code in codes):
        raise RuntimeError(f"ranks exited with codes {codes} (timeout {TIMEOUT_S:.0f} s?)")
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(size)]


def _integers(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator("cuda").manual_seed(seed)
    return torch.randint(-16, 17, shape, generator=g, device="cuda").to(dtype)


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    torch.distributed.all_reduce(y)
    return y


def _custom_vs_nccl(tp: Any) -> dict[str, Any]:
    """Every (dtype, shape, path) as (eager equal, graph equal on input 1, on input 2, normal
    inputs' max |diff| in ulps); plus what the production plan took."""
    from mlaserve.custom_all_reduce import ONE_SHOT, TWO_SHOT, AllReducePlan, CustomAllReduce
    from mlaserve.tensor_parallel import all_reduce

    device = torch.device("cuda", torch.cuda.current_device())
    if tp.custom is None:
        raise RuntimeError("init_tensor_parallel set up no custom all-reduce (see the log)")
    biggest = max(r * c for r, c in SHAPES) * 4
    # Its own group: symmetric memory rendezvouses once per group name in a process, and the
    # default group already did (tp.custom); a second rendezvous there is refused by design.
    forced_group = torch.distributed.new_group(list(range(tp.size)), backend="nccl")
    forced = CustomAllReduce.create(forced_group, device, AllReducePlan(biggest, biggest))
    if forced is None:
        raise RuntimeError("the forced-plan CustomAllReduce could not be made (see the log)")
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        ONE_SHOT: lambda x: forced.all_reduce(x, ONE_SHOT),
        TWO_SHOT: lambda x: forced.all_reduce(x, TWO_SHOT),
        "dispatch": lambda x: all_reduce(x.clone(), tp),  # NCCL's path reduces its input in place
    }
    bs1 = torch.empty(1, HIDDEN, device=device, dtype=torch.bfloat16)
    out: dict[str, Any] = {"handles_bs1": tp.custom.handles(bs1)}
    for dtype in (torch.bfloat16, torch.float32):
        eps = torch.finfo(dtype).eps
        for i, shape in enumerate(SHAPES):
            seed = 1000 * tp.rank + 10 * i + (dtype == torch.float32)
            x1, x2 = _integers(shape, dtype, seed), _integers(shape, dtype, seed + 5)
            want1, want2 = _nccl_sum(x1), _nccl_sum(x2)
            normal = torch.randn(shape, generator=torch.Generator("cuda").manual_seed(seed),
                                 device="cuda").to(dtype)  # fmt: skip
            want_normal = _nccl_sum(normal)
            static = torch.zeros_like(x1)
            for fn in paths.values():  # warm-up outside the capture (allocations, lazy init)
                fn(static)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = {name: fn(static) for name, fn in paths.items()}
            for name, fn in paths.items():
                eager = torch.equal(fn(x1), want1)
                static.copy_(x1)
                graph.replay()
                in_graph1 = torch.equal(captured[name], want1)
                static.copy_(x2)
                graph.replay()
                in_graph2 = torch.equal(captured[name], want2)
                diff = (fn(normal).float() - want_normal.float()).abs()
                ulps = (diff / (eps * want_normal.float().abs().clamp_min(1.0))).max().item()
                out[f"{dtype} {shape} {name}"] = (eager, in_graph1, in_graph2, ulps)
            del graph
    forced.close()
    return out


def test_custom_all_reduce_equals_nccl_in_and_out_of_graphs(tmp_path: Path) -> None:
    results = run_on_gpus(_custom_vs_nccl, 2, tmp_path)
    for rank, result in enumerate(results):
        assert result.pop("handles_bs1"), f"rank {rank}: the 2-GPU plan declines [1, 7168] bf16"
        assert len(result) == 2 * len(SHAPES) * 3
        for case, (eager, graph1, graph2, ulps) in result.items():
            print(f"rank {rank} {case}: eager {eager} graph {graph1}/{graph2} max {ulps:.2f} ulp")
            assert eager and graph1 and graph2, f"rank {rank} {case}: differs from NCCL's sum"
            assert ulps <= ULPS, f"rank {rank} {case}: {ulps:.2f} ulps from NCCL"
