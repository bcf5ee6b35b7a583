"""Cost of the sampler at large vocabularies: greedy, seeded sampling with filters, and
speculative acceptance, per batch size.

    python3 bench/sampler.py [--device cuda] [--vocabs 102400 129280] [--batch-sizes 1 8 32 64]

Each cell is the median of `--iters` timed calls after `--warmup` calls, on logits already on
the device and a `SamplingBatch` already built (from `SamplingSlots`, as the engine would), so
it is the sampler's own device time: CUDA events around each call on a GPU, wall time on CPU.
`batch` is the separate per-step cost of `SamplingSlots.batch` (host + one small copy). The
noise rows time the counter-based Gumbel noise alone, fused (Triton, CUDA only) and reference
(torch ops). `[graph]` rows: the same call captured in a CUDA graph and replayed, i.e. its
device time without host launch gaps (which in the engine overlap the forward). The budget column is 5% of a 2.5 ms V2-Lite bs-1 decode step (125 us, issue 8).
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from mlaserve.sampling import Sampler, SamplingSlots
from mlaserve.sampling.noise_kernel import fused_noise, fused_noise_available
from mlaserve.sampling.random import reference_gumbel_noise, stream_keys
from mlaserve.sampling.rejection import accept_draft
from mlaserve.sampling_params import SamplingParams

BUDGET_US = 125.0

CASES: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "t=1 seeded": SamplingParams(temperature=1.0, seed=1),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50, seed=1),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    "k+p+min-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1),
    "min-p 0.05": SamplingParams(temperature=0.8, min_p=0.05, seed=1),
}


def timer(device: torch.device, fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median microseconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocabs", type=int, nargs="+", default=[102400, 129280])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--spec-k", type=int, default=3, help="draft tokens for the accept rows")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument(
        "--profile", action="store_true", help="top kernels per case at the largest vocab, bs 1/64"
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    sampler = Sampler()
    rows: list[dict] = []

    def add(vocab: int, bs: int, name: str, us: float) -> None:
        rows.append({"vocab": vocab, "bs": bs, "case": name, "us": round(us, 1)})

    for vocab in args.vocabs:
        for bs in args.batch_sizes:
            gen = torch.Generator(device=device).manual_seed(bs)
            logits = torch.randn(bs, vocab, device=device, generator=gen) * 4
            for name in args.cases:
                slots = SamplingSlots(bs * (args.spec_k + 1), vocab, device)
                for s in range(bs):
                    slots.admit(s, CASES[name], seed=s, prompt_ids=[1, 2, 3])
                batch = slots.batch(list(range(bs)), [5] * bs)
                add(vocab, bs, name, timer(device, partial(sampler, logits, batch), *_n(args)))
                if device.type == "cuda" and name != "greedy":
                    add(vocab, bs, f"{name} [graph]", _graph_us(partial(sampler, logits, batch)))
                if name in ("greedy", "k+p+min-p"):
                    add(vocab, bs, f"batch ({name})", _host_timer(slots, bs, args))
                    k = args.spec_k
                    verify = slots.verify_batch(list(range(bs)), [5] * bs, k)
                    vlogits = torch.randn(bs, k + 1, vocab, device=device, generator=gen)
                    draft = vlogits[:, :k].argmax(-1)
                    add(
                        vocab,
                        bs,
                        f"accept k={k} ({name})",
                        timer(device, partial(accept_draft, vlogits, draft, verify), *_n(args)),
                    )
            seeds = torch.arange(bs, device=device)
            steps = torch.zeros(bs, dtype=torch.int64, device=device)
            ids = torch.arange(vocab, device=device)
            add(
                vocab,
                bs,
                "noise (reference)",
                timer(device, partial(reference_gumbel_noise, seeds, steps, ids), *_n(args)),
            )
            if fused_noise_available(device):
                keys = stream_keys(seeds, steps)
                add(
                    vocab,
                    bs,
                    "noise (fused)",
                    timer(device, partial(fused_noise, keys, ids, gumbel=True), *_n(args)),
                )
            print(f"# vocab {vocab} bs {bs} done", flush=True)

    _print_table(rows, args)
    if args.profile and device.type == "cuda":
        _profile(sampler, max(args.vocabs), args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"bench": "sampler", "device": name, "budget_us": BUDGET_US, "rows": rows}))


def _graph_us(fn: Callable[[], object], iters: int = 20) -> float:
    """Device time of one call: the call captured in a CUDA graph, mean over replays. Host
    launch cost excluded: in the engine it overlaps the forward still running on the GPU."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _profile(sampler: Sampler, vocab: int, args: argparse.Namespace) -> None:
    """Where a call's GPU time goes: torch.profiler over 10 calls, top kernels per case."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    for bs in (1, 64):
        logits = torch.randn(bs, vocab, device=device) * 4
        for name in args.cases:
            slots = SamplingSlots(bs, vocab, device)
            for s in range(bs):
                slots.admit(s, CASES[name], seed=s, prompt_ids=[1, 2, 3])
            batch = slots.batch(list(range(bs)), [5] * bs)
            for _ in range(3):
                sampler(logits, batch)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    sampler(logits, batch)
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
            events.sort(key=lambda e: e.self_device_time_total, reverse=True)
            total = sum(e.self_device_time_total for e in events) / 10
            launches = sum(e.count for e in events) / 10
            print(
                f"\nprofile vocab {vocab} bs {bs} {name}: {total:.1f} us GPU, {launches:.0f} kernels"
            )
            for e in events[:6]:
                print(
                    f"  {e.self_device_time_total / 10:8.1f} us  x{e.count // 10:<3} {e.key[:80]}"
                )


def _n(args: argparse.Namespace) -> tuple[int, int]:
    return args.warmup, args.iters


def _host_timer(slots: SamplingSlots, bs: int, args: argparse.Namespace) -> float:
    """Wall time of SamplingSlots.batch (host work + its one copy), synchronised."""
    device = slots.device

    def build() -> None:
        slots.batch(list(range(bs)), [5] * bs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        build()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        build()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cell = {(r["vocab"], r["bs"], r["case"]): r["us"] for r in rows}
    for vocab in args.vocabs:
        print(f"\nvocab {vocab}: median us per call (budget {BUDGET_US:.0f} us; * = over)")
        header = f"{'case':<26}" + "".join(f"{'bs ' + str(bs):>11}" for bs in args.batch_sizes)
        print(header)
        for case in cases:
            line = f"{case:<26}"
            for bs in args.batch_sizes:
                us = cell.get((vocab, bs, case))
                mark = "*" if us is not None and us > BUDGET_US and "batch" not in case else " "
                line += f"{'-' if us is None else f'{us:.1f}':>10}{mark}"
            print(line)


if __name__ == "__main__":
    main()
