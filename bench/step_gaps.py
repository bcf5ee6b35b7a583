"""Where a graphed decode step's GPU time goes besides the graph: the kernels and copies the
engine runs around each replay (input upload, sampling, read-back) and the idle gaps between
consecutive GPU operations, over a run of steady engine steps.

    python3 bench/step_gaps.py --model /tmp/v2lite --batch-size 1 --context 1024

Runs `--steps` engine steps under torch.profiler (CUPTI: every kernel node of a replayed graph
is recorded), with overlap scheduling as configured (`--no-overlap` for synchronous steps).
Prints the wall time per step, the GPU busy time per step, the operations outside the graph
(by name, per step) and the largest gaps with the operations around them; then a JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from decode import fake_prefill, finish_all, replay_kernels

from mlaserve import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--gaps", type=int, default=12, help="largest gaps to list")
    args = parser.parse_args()
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(
        args.model,
        max_num_seqs=max(args.batch_size, 8),
        max_model_len=args.context + 4 * args.steps + 64,
        overlap_schedule=not args.no_overlap,
        enable_prefix_caching=False,  # fake_prefill's random KV must not become cached pages
    )
    engine = llm.engine
    fake_prefill(llm, args.batch_size, args.context, new_tokens=3 * args.steps + 16)
    for _ in range(args.steps):  # warm
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
    finish_all(llm)
    ops = sorted(
        (
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type == DeviceType.CUDA
        ),
    )
    graph_names = {name for name, _, _ in _graph_kernels(engine, args.batch_size)}
    busy = sum(end - start for start, end, _ in ops) / args.steps / 1e3
    span = (ops[-1][1] - ops[0][0]) / args.steps / 1e3
    outside: dict[str, list[float]] = {}
    for start, end, name in ops:
        if name not in graph_names:
            outside.setdefault(name, []).append((end - start) / 1e3)
    gaps = sorted(((b[0] - a[1]) / 1e3, a[2], b[2]) for a, b in itertools.pairwise(ops))[::-1]
    total_gap = sum(g for g, _, _ in gaps if g > 0) / args.steps
    print(
        f"bs {args.batch_size} ctx {args.context} overlap {engine.overlap}: wall {wall:.3f} ms "
        f"per step, GPU span {span:.3f} ms, busy {busy:.3f} ms, idle {total_gap:.3f} ms"
    )
    print("operations outside the decode graph, per step:")
    for name, times in sorted(outside.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"  {sum(times) / args.steps * 1e3:8.1f} us  x{len(times) / args.steps:4.1f}  "
            f"{name[:100]}"
        )
    print(f"largest gaps (of {len(gaps)}):")
    for gap, before, after in gaps[: args.gaps]:
        print(f"  {gap * 1e3:8.1f} us  after {before[:50]}  before {after[:50]}")
    print(
        json.dumps(
            {
                "bs": args.batch_size,
                "ctx": args.context,
                "overlap": engine.overlap,
                "wall_ms": wall,
                "gpu_span_ms": span,
                "gpu_busy_ms": busy,
                "gpu_idle_ms": total_gap,
                "outside_us": {k: sum(v) / args.steps * 1e3 for k, v in outside.items()},
            }
        )
    )


def _graph_kernels(engine, bs: int) -> list[tuple[str, float, float]]:
    graphs = engine.graphs
    size = min(s for s in graphs.batch_sizes if s >= bs)
    graph = next(g for (m, q, b), g in graphs.graphs.items() if b == size and q == 1).graph
    return replay_kernels(graph)


if __name__ == "__main__":
    main()
