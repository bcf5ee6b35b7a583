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


# (T, slots) of the fused all-reduce + norm's calls: one row to the 32-row bound, one slot (a
# row-parallel linear's sum) and an MoE layer's nine; the graph's chain changes T call to call,
# so the rows' call counts (and their slots' parities) drift apart, and calls each case three
# times in a row (under PDL a call launches while the one before it, on the same rows, runs).
NORM_CASES = [(1, 1), (3, 9), (8, 1), (32, 1), (1, 9), (5, 1)]
NORM_REPLAYS = 41


def _unfused(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Any:
    """The path the fused kernel replaces: slots summed in order, NCCL's all-reduce (fp32),
    then add_partials_rms_norm on the one part."""
    from mlaserve.ops.rms_norm import add_partials_rms_norm

    own = parts[:, 0]
    for s in range(1, parts.shape[1]):
        own = own + parts[:, s]
    return add_partials_rms_norm(_nccl_sum(own)[:, None].contiguous(), residual, weight, 1e-6)


def _fused_norm_vs_unfused(tp: Any) -> dict[str, Any]:
    """Per case, eager and in a graph of the whole chain replayed NORM_REPLAYS times on fresh
    inputs: whether the fused outputs (through `reduce_add_rms_norm`, as the model's norm
    calls it) equal the unfused path's bitwise; the last replay's outputs, for the ranks'
    comparison; and whether 33 rows are declined."""
    from mlaserve.tensor_parallel import RankPartials, reduce_add_rms_norm

    device = torch.device("cuda", torch.cuda.current_device())
    if tp.custom is None or tp.custom.exchange is None:
        raise RuntimeError("init_tensor_parallel set up no fused all-reduce + norm (see the log)")
    g = torch.Generator("cuda").manual_seed(5)  # the same weight and residuals on every rank
    weight = (torch.rand(HIDDEN, generator=g, device="cuda") + 0.5).to(torch.bfloat16)

    def inputs(case: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, slots = NORM_CASES[case]
        mine = torch.Generator("cuda").manual_seed(1000 * tp.rank + seed)
        shared = torch.Generator("cuda").manual_seed(seed)
        parts = torch.randn(num_tokens, slots, HIDDEN, generator=mine, device=device)
        residual = torch.randn(num_tokens, HIDDEN, generator=shared, device=device) * 4
        return parts, residual.to(torch.bfloat16)

    def fused(parts: torch.Tensor, residual: torch.Tensor) -> Any:
        out = reduce_add_rms_norm(RankPartials(parts, torch.bfloat16, tp), residual, weight, 1e-6)
        if out is None:
            raise RuntimeError(f"the fused path declined {tuple(parts.shape)}")
        return out

    result: dict[str, Any] = {}
    for case in range(len(NORM_CASES)):
        parts, residual = inputs(case, case)
        got, want = fused(parts, residual), _unfused(parts, residual, weight)
        result[f"eager {NORM_CASES[case]}"] = all(map(torch.equal, got, want))
    statics = [inputs(case, 100 + case) for case in range(len(NORM_CASES))]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # each case 3 times back to back: a kernel after its own call
        captured = [[fused(parts, residual) for _ in range(3)][-1] for parts, residual in statics]
    equal = [True] * len(NORM_CASES)
    for replay in range(NORM_REPLAYS):
        for case, (parts, residual) in enumerate(statics):
            fresh = inputs(case, 200 + 10 * replay + case)
            parts.copy_(fresh[0])
            residual.copy_(fresh[1])
        graph.replay()
        for case, (parts, residual) in enumerate(statics):
            want = _unfused(parts, residual, weight)
            equal[case] &= all(map(torch.equal, captured[case], want))
    for case, same in enumerate(equal):
        result[f"graph {NORM_CASES[case]}"] = same
    result["last"] = [tuple(t.cpu() for t in out) for out in captured]
    too_many = RankPartials(torch.zeros(33, 1, HIDDEN, device=device), torch.bfloat16, tp)
    result["declines_33"] = reduce_add_rms_norm(too_many, statics[0][1][:1], weight, 1e-6) is None
    del graph
    return result


def test_fused_all_reduce_norm_equals_the_unfused_path(tmp_path: Path) -> None:
    """Bitwise: on 2 ranks the fused kernel adds the same two fp32 values as NCCL, rounds as
    add_partials_rms_norm does and normalises with the same block; both ranks hold the same
    outputs."""
    results = run_on_gpus(_fused_norm_vs_unfused, 2, tmp_path)
    lasts = [result.pop("last") for result in results]
    for rank, result in enumerate(results):
        assert result.pop("declines_33"), f"rank {rank}: 33 rows taken past the exchange"
        for case, same in result.items():
            print(f"rank {rank} {case}: {same}")
            assert same, f"rank {rank} {case}: the fused outputs differ from the unfused path's"
    for case, (a, b) in enumerate(zip(*lasts, strict=True)):
        assert all(map(torch.equal, a, b)), f"{NORM_CASES[case]}: the ranks' outputs differ"
