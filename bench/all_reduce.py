"""All-reduce time per call inside a CUDA graph at decode sizes: NCCL, torch symmetric memory's
one-shot and two-shot (mlaserve/custom_all_reduce.py, input copy included), and the path the
engine chooses (`tensor_parallel.all_reduce`).

    python3 bench/all_reduce.py --gpus 4                 # [bs, 7168] and [bs, 2048] bf16
    python3 bench/all_reduce.py --gpus 2 --widths 7168 --batch-sizes 1 8 64

Spawns --gpus processes (rank r on cuda:r, NCCL, NVLink multicast off: tp_worker.MULTICAST_OFF),
each joined through `init_tensor_parallel` as the engine's ranks are, so "chosen" is the group's
own `CustomAllReduce` with the measured plan (or NCCL where it declines). One-shot and two-shot
are forced through a second `CustomAllReduce` whose plan gives every size to both.

Per (width, bs) and path: `--calls` all-reduces of one [bs, width] bf16 tensor captured in one
CUDA graph, replayed `--reps` times after a warm-up; time per call = replay / calls (CUDA
events), the median over replays, the max over ranks (a collective waits for its slowest rank).
Before timing, each path's sum of random normal inputs is compared with NCCL's: max |diff| in
ulps of the result (bf16 eps x max(|NCCL|, 1)); `ok` when <= `ULPS` (the order of the adds
differs between the paths: a rounding or two apart).

Then, with `--norm-batch-sizes`, the all-reduce fused with the residual-add + RMSNorm after it
(`CustomAllReduce.all_reduce_add_rms_norm`, the engine's group) against what it replaces: the
fp32 partial sum [bs, width] through the forced one-shot, then `add_partials_rms_norm` (one
part, the bf16 residual), and the norm alone; time per call as above; `same` when the fused
outputs equal the unfused bitwise on every rank.

Prints a table, the plan this run's numbers imply (the bound per path for
`custom_all_reduce.MEASURED_PLANS`: one-shot up to the largest size where it is the fastest,
two-shot up to the largest size past that where it beats NCCL), and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

PATHS = ("nccl", "one_shot", "two_shot", "chosen")
ULPS = 4.0  # up to 8 ranks: a few roundings apart at most


def _time_graph(fn: Any, x: torch.Tensor, calls: int, reps: int) -> float:
    """us per call: `calls` calls of fn(x) in one CUDA graph, median over `reps` replays, each
    started after a barrier (the ranks' replays start together: skew is not timed)."""
    import torch.distributed as dist

    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        dist.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def _rank_main(rank: int, size: int, workdir: str, args: dict[str, Any]) -> None:
    import torch.distributed as dist

    from mlaserve.custom_all_reduce import ONE_SHOT, TWO_SHOT, AllReducePlan, CustomAllReduce
    from mlaserve.tensor_parallel import all_reduce, destroy_tensor_parallel, init_tensor_parallel

    out, tp = Path(workdir), None
    try:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        tp = init_tensor_parallel(
            rank, size, backend="nccl", init_method=f"file://{out / 'store'}", timeout_s=120.0
        )
        # bf16 rows, and the norm table's fp32 rows
        widest = max(args["batch_sizes"] + [2 * n for n in args["norm_batch_sizes"]])
        biggest = widest * max(args["widths"]) * 2
        # Its own group: symmetric memory rendezvouses once per group name in a process, and
        # the engine's group already did (tp.custom).
        forced_group = dist.new_group(list(range(size)), backend="nccl")
        forced = CustomAllReduce.create(forced_group, device, AllReducePlan(biggest, biggest))
        if forced is None:
            raise RuntimeError("symmetric memory unavailable on this host (the log says why)")

        def nccl(x: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(x)
            return x

        fns = {
            "nccl": nccl,
            "one_shot": lambda x: forced.all_reduce(x, ONE_SHOT),
            "two_shot": lambda x: forced.all_reduce(x, TWO_SHOT),
            "chosen": lambda x: all_reduce(x, tp),
        }
        rows = []
        for width in args["widths"]:
            for bs in args["batch_sizes"]:
                g = torch.Generator(device).manual_seed(1000 * rank + bs)
                x = torch.randn(bs, width, generator=g, device=device).to(torch.bfloat16)
                want = nccl(x.clone()).float()
                scale = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1.0)
                ulps = {
                    name: ((fn(x.clone()).float() - want).abs() / scale).max().item()
                    for name, fn in fns.items()
                    if name != "nccl"
                }
                times = torch.tensor(
                    [_time_graph(fns[p], x.clone(), args["calls"], args["reps"]) for p in PATHS],
                    device=device,
                )
                dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's
                worst = torch.tensor(list(ulps.values()), device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                nbytes = bs * width * 2
                chosen = "nccl"
                if tp.custom is not None and tp.custom.handles(x):
                    chosen = tp.custom.plan.choose(nbytes)
                row = {"width": width, "bs": bs, "bytes": nbytes, "chosen": chosen}
                row |= {f"{p}_us": t for p, t in zip(PATHS, times.tolist(), strict=True)}
                row |= {f"{p}_ulps": u for p, u in zip(ulps, worst.tolist(), strict=True)}
                row["best_us"] = min(row["nccl_us"], row["one_shot_us"], row["two_shot_us"])
                row["ok"] = max(worst.tolist()) <= ULPS
                rows.append(row)
        norm_rows = _norm_rows(tp, forced, args)
        forced.close()
        if rank == 0:
            plan = tp.custom.plan if tp.custom is not None else None
            (out / "result.json").write_text(
                json.dumps({"rows": rows, "norm_rows": norm_rows, "plan": plan and plan.__dict__})
            )
        dist.barrier()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if tp is not None:
            destroy_tensor_parallel(tp)


def _norm_rows(tp: Any, forced: Any, args: dict[str, Any]) -> list[dict[str, Any]]:
    """The fused all-reduce + residual-add + RMSNorm against the one-shot then the norm (module
    doc), per (width, bs) of `norm_batch_sizes`; every rank calls it."""
    import torch.distributed as dist

    from mlaserve.custom_all_reduce import ONE_SHOT
    from mlaserve.ops.rms_norm import add_partials_rms_norm

    rows: list[dict[str, Any]] = []
    if tp.custom is None or tp.custom.exchange is None:
        return rows
    device = tp.custom.device
    for width in args["widths"]:
        for bs in args["norm_batch_sizes"]:
            g = torch.Generator(device).manual_seed(7 * tp.rank + bs)
            parts = torch.randn(bs, 1, width, generator=g, device=device)
            residual = torch.randn(bs, width, device=device).to(torch.bfloat16)
            dist.broadcast(residual, 0)
            weight = torch.ones(width, device=device, dtype=torch.bfloat16)
            if not tp.custom.handles_norm(parts):
                continue

            def fused(x: torch.Tensor, residual=residual, weight=weight) -> Any:
                return tp.custom.all_reduce_add_rms_norm(x, residual, weight, 1e-6)

            def unfused(x: torch.Tensor, residual=residual, weight=weight) -> Any:
                total = forced.all_reduce(x.view(x.shape[0], -1), ONE_SHOT)
                return add_partials_rms_norm(total.view_as(x), residual, weight, 1e-6)

            def norm_alone(x: torch.Tensor, residual=residual, weight=weight) -> Any:
                return add_partials_rms_norm(x, residual, weight, 1e-6)

            a, b = fused(parts), unfused(parts)
            same = torch.tensor(
                [int(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))], device=device
            )
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            fns = (fused, unfused, norm_alone)
            times = torch.tensor(
                [_time_graph(fn, parts, args["calls"], args["reps"]) for fn in fns], device=device
            )
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            fused_us, unfused_us, norm_us = times.tolist()
            rows.append({"width": width, "bs": bs, "fused_us": fused_us,
                         "unfused_us": unfused_us, "norm_us": norm_us,
                         "same": bool(same.item())})  # fmt: skip
    return rows


def measure(
    gpus: int,
    widths: list[int],
    batch_sizes: list[int],
    calls: int = 50,
    reps: int = 20,
    norm_batch_sizes: list[int] | None = None,
) -> dict[str, Any]:
    """Run the measurement on `gpus` spawned ranks: {"rows": [...], "plan": the group's plan}."""
    from mlaserve.engine.tp_worker import MULTICAST_OFF

    if torch.cuda.device_count() < gpus:
        raise SystemExit(f"--gpus {gpus}: only {torch.cuda.device_count()} GPUs visible")
    for key, value in MULTICAST_OFF.items():  # the ranks inherit these
        os.environ.setdefault(key, value)
    args = {"widths": widths, "batch_sizes": batch_sizes, "calls": calls, "reps": reps,
            "norm_batch_sizes": norm_batch_sizes or []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-all-reduce-") as workdir:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, gpus, workdir, args)) for r in range(gpus)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 600
        try:  # a failed rank: kill the others at once (they would wait in a collective)
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode for p in procs):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(10)
        errors = [Path(workdir) / f"rank{r}.err" for r in range(gpus)]
        if any(e.exists() for e in errors):
            raise RuntimeError("\n".join(e.read_text() for e in errors if e.exists()))
        return json.loads((Path(workdir) / "result.json").read_text())


def implied_plan(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The bounds these rows support, at the measured sizes: one-shot up to the largest size
    where it was the fastest; two-shot up to the largest size past that where it beat NCCL."""
    one = max((r["bytes"] for r in rows if r["one_shot_us"] == r["best_us"]), default=0)
    two = max(
        (r["bytes"] for r in rows if r["bytes"] > one and r["two_shot_us"] < r["nccl_us"]),
        default=0,
    )
    return {"one_shot_max_bytes": one, "two_shot_max_bytes": two}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--widths", type=int, nargs="+", default=[7168, 2048])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--calls", type=int, default=50, help="all-reduces per captured graph")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed")
    ap.add_argument("--norm-batch-sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32],
                    help="the fused all-reduce + norm's table (none: skipped)")  # fmt: skip
    args = ap.parse_args()
    result = measure(
        args.gpus, args.widths, args.batch_sizes, args.calls, args.reps, args.norm_batch_sizes
    )
    rows = result["rows"]
    device = torch.cuda.get_device_name()
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    print(f"device: {args.gpus} x {device}, NCCL {nccl}, "
          f"torch {torch.__version__}; us per call in a graph of {args.calls}, max over ranks; "
          f"engine plan {result['plan']}")  # fmt: skip
    print(f"{'width':>6} {'bs':>4} {'KiB':>7} {'NCCL':>7} {'1-shot':>7} {'2-shot':>7} "
          f"{'chosen':>7} {'path':>9} {'best/NCCL':>9} {'ulps 1/2/ch':>14} ok")  # fmt: skip
    for r in rows:
        ulps = f"{r['one_shot_ulps']:.1f}/{r['two_shot_ulps']:.1f}/{r['chosen_ulps']:.1f}"
        print(
            f"{r['width']:>6} {r['bs']:>4} {r['bytes'] / 1024:>7.1f} {r['nccl_us']:>7.1f} "
            f"{r['one_shot_us']:>7.1f} {r['two_shot_us']:>7.1f} {r['chosen_us']:>7.1f} "
            f"{r['chosen']:>9} {r['best_us'] / r['nccl_us']:>9.2f} {ulps:>14} {r['ok']}"
        )
    implied = {w: implied_plan([r for r in rows if r["width"] == w]) for w in args.widths}
    for width, plan in implied.items():
        print(f"plan implied by width {width}: {plan}")
    if result["norm_rows"]:
        print("all-reduce + residual-add + RMSNorm, fp32 partials, us per call:")
        print(f"{'width':>6} {'bs':>4} {'fused':>7} {'1-shot+norm':>11} {'norm':>7} "
              f"{'fused/unfused':>13} same")  # fmt: skip
    for r in result["norm_rows"]:
        print(f"{r['width']:>6} {r['bs']:>4} {r['fused_us']:>7.1f} {r['unfused_us']:>11.1f} "
              f"{r['norm_us']:>7.1f} {r['fused_us'] / r['unfused_us']:>13.2f} {r['same']}")  # fmt: skip
    print(
        json.dumps(
            {
                "bench": "all_reduce",
                "device": device,
                "gpus": args.gpus,
                "calls_per_graph": args.calls,
                "engine_plan": result["plan"],
                "implied_plans": implied,
                "all_ok": all(r["ok"] for r in rows),
                "rows": rows,
                "norm_rows": result["norm_rows"],
            }
        )
    )


if __name__ == "__main__":
    main()
