"""Prefix caching, cache on against cache off, on the issue's two workloads (issue 43).

    shared   U users share one system prompt of S tokens, each asks a question of Q tokens
             (all at once, `--concurrency` in flight)
    chat     U users each hold a T-turn conversation; every turn appends about A new tokens
             to the conversation so far (and the previous answer's length in filler tokens:
             the completions endpoint returns text, so the answer is stood in for by a fixed
             token run; the cached prefix is the previous turn's prompt, as in a real chat
             whose answer re-tokenizes differently)
    decode   the shared system prompt again with new questions, all U users at once,
             `--decode-tokens` each: the issue's "decode TPOT within 3% of cache-off at the same
             batch size", read as `steady_tpot_ms` (below)

For each mode the script starts a server (like bench/soak.py: `python -m mlaserve serve`, the
options after `--` passed through), runs the workloads with streaming token-id completions
(greedy, ignore_eos, `--max-tokens` each), and reads TTFT per request (first streamed chunk),
TPOT per request ((last chunk - first chunk) / (tokens - 1): with the cache off it includes
the steps shared with other requests' longer prefills), output tok/s (completion tokens / the
workload's wall time), the hit rate from the server's `mlaserve:prefix_cache_hits_total /
prefix_cache_queries_total`, and `steady_tpot_ms`: the decode step's time per token while every
request of the workload decodes at once (`steady_tpot`: same batch, no prefill in the steps).
Prints a table and one JSON line.

GPU (V3-lite), the issue's sizes (the defaults):
    python3 bench/prefix_cache.py --model /models/DeepSeek-V2-Lite -- --max-num-seqs 64
CPU smoke (tests/bench/test_prefix_cache_bench.py):
    python3 bench/prefix_cache.py --device cpu --users 4 --system-tokens 48 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.soak import Target, quantile


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


async def _one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft, last, usage, times = None, None, None, []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                times.append(time.perf_counter())
                last = times[-1] - t0
                ttft = last if ttft is None else ttft
            if chunk.get("usage"):
                usage = chunk["usage"]
    tokens = usage["completion_tokens"] if usage else 0
    # TPOT: the decode's mean time per token after the first (streamed chunks carry >= 1).
    tpot = (last - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens, "chunk_times": times}


async def shared_workload(url: str, args: argparse.Namespace) -> tuple[list[dict], float]:
    rng = random.Random(args.seed)
    system = _tokens(rng, args.system_tokens)
    prompts = [system + _tokens(rng, args.question_tokens) for _ in range(args.users)]
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s) as client:

        async def run(p: list[int]) -> dict:
            async with sem:
                return await _one(client, p, args.max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        return list(results), time.perf_counter() - t0


async def chat_workload(url: str, args: argparse.Namespace) -> tuple[list[dict], float]:
    rng = random.Random(args.seed + 1)
    sem = asyncio.Semaphore(args.concurrency)
    answer = [7] * args.max_tokens  # stands in for the previous answer (see the docstring)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s) as client:

        async def user(u: int) -> list[dict]:
            history: list[int] = _tokens(random.Random(args.seed * 1000 + u), 8)
            out = []
            for _ in range(args.turns):
                history = history + _tokens(rng, args.turn_tokens)
                async with sem:
                    out.append(await _one(client, history, args.max_tokens))
                history = history + answer
            return out

        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(user(u) for u in range(args.users)))
        return [r for rs in per_user for r in rs], time.perf_counter() - t0


async def decode_workload(url: str, args: argparse.Namespace) -> tuple[list[dict], float]:
    """The shared system prompt again (cached in the cache-on run by the shared workload), new
    questions, `--decode-tokens` each, all users at once: long enough that every user decodes
    at the same time for a while in both modes (see `steady_tpot`)."""
    rng = random.Random(args.seed + 2)
    system = _tokens(random.Random(args.seed), args.system_tokens)
    prompts = [system + _tokens(rng, args.question_tokens) for _ in range(args.users)]
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, p, args.decode_tokens) for p in prompts))
        return list(results), time.perf_counter() - t0


def steady_tpot(results: list[dict]) -> tuple[float | None, float]:
    """Decode TPOT at one batch size: inside the window from the last request's first token to
    the first request's last, every request is decoding (the batch is all of them, in both
    modes, with no prefill in its steps), so the median over requests of (chunk time span /
    chunks - 1) there is the decode step's time per token at that batch size (one token per
    chunk: no speculation). -> (ms, window seconds); None where the window holds < 3 chunks."""
    runs = [r["chunk_times"] for r in results if r["chunk_times"]]
    if len(runs) != len(results) or not runs:
        return None, 0.0
    start, end = max(t[0] for t in runs), min(t[-1] for t in runs)
    per_request = []
    for t in runs:
        inside = [x for x in t if start <= x <= end]
        if len(inside) >= 3:
            per_request.append((inside[-1] - inside[0]) / (len(inside) - 1))
    if len(per_request) != len(runs):
        return None, max(0.0, end - start)
    return round(quantile(per_request, 0.5) * 1e3, 3), round(end - start, 3)


def _summary(results: list[dict], wall: float, before: dict, after: dict) -> dict:
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    queries = after.get("mlaserve:prefix_cache_queries_total", 0) - before.get(
        "mlaserve:prefix_cache_queries_total", 0
    )
    hits = after.get("mlaserve:prefix_cache_hits_total", 0) - before.get(
        "mlaserve:prefix_cache_hits_total", 0
    )
    p50, p99 = quantile(ttfts, 0.5), quantile(ttfts, 0.99)
    tpot = quantile([r["tpot"] for r in results if r["tpot"] is not None], 0.5)
    steady_ms, window_s = steady_tpot(results)
    return {
        "steady_tpot_ms": steady_ms,
        "steady_window_s": window_s,
        "requests": len(results),
        "ttft_p50_ms": None if p50 is None else round(p50 * 1e3, 2),
        "ttft_p99_ms": None if p99 is None else round(p99 * 1e3, 2),
        "tpot_p50_ms": None if tpot is None else round(tpot * 1e3, 3),
        "output_tok_s": round(sum(r["tokens"] for r in results) / wall, 2) if wall else None,
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
    }


def run_mode(cache: bool, args: argparse.Namespace, options: list[str]) -> dict:
    flag = "--enable-prefix-caching" if cache else "--no-enable-prefix-caching"
    opts = ["--device", args.device, flag, *options]
    log = Path(tempfile.mkdtemp()) / f"server-{'on' if cache else 'off'}.log"
    target = Target.start(args.model, log, opts, args.startup_timeout_s)
    # The metrics arrive with the engine's stats, sent at most every 50 ms while busy and
    # always when it goes idle: wait for the idle stats before reading the counters.
    out = {}
    try:
        workloads = {"shared": shared_workload, "chat": chat_workload}
        if args.decode_tokens:
            workloads["decode"] = decode_workload
        for name in args.workloads.split(","):
            workload = workloads[name]
            before = target.metrics()
            results, wall = asyncio.run(workload(target.url, args))
            time.sleep(0.5)
            out[name] = _summary(results, wall, before, target.metrics())
    finally:
        target.stop()
    return out


def print_table(report: dict) -> None:
    cols = ("requests", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "steady_tpot_ms",
            "output_tok_s", "hit_rate")  # fmt: skip
    print(f"{'workload':<8} {'cache':<5} " + " ".join(f"{c:>13}" for c in cols))
    names = [w for w in ("shared", "chat", "decode") if w in report["off"]]
    for workload in names:
        for mode in ("off", "on"):
            row = report[mode][workload]
            print(f"{workload:<8} {mode:<5} " + " ".join(f"{row[c]!s:>13}" for c in cols))
    for workload in [w for w in ("shared", "chat") if w in names]:
        off, on = report["off"][workload]["ttft_p50_ms"], report["on"][workload]["ttft_p50_ms"]
        if off and on:
            print(f"{workload}: TTFT p50 {off / on:.2f}x lower with the cache")
    if "decode" in names:
        off, on = report["off"]["decode"], report["on"]["decode"]
        if off["steady_tpot_ms"] and on["steady_tpot_ms"]:
            ratio = on["steady_tpot_ms"] / off["steady_tpot_ms"]
            print(f"decode: steady TPOT at batch {off['requests']}: {on['steady_tpot_ms']} ms "
                  f"with the cache, {off['steady_tpot_ms']} ms without ({ratio:.3f}x; windows "
                  f"{on['steady_window_s']} / {off['steady_window_s']} s)")  # fmt: skip
        else:
            print("decode: no window where every request decodes (raise --decode-tokens)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the shipped model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=1024,
                   help="the decode workload's tokens per user (0: skip it)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--modes", default="off,on", help="which of off,on to run")
    p.add_argument("--workloads", default="shared,chat,decode",
                   help="which of shared,chat,decode to run, in this order")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser().parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    unknown = set(args.workloads.split(",")) - {"shared", "chat", "decode"}
    if unknown or (not args.decode_tokens and "decode" in args.workloads.split(",")):
        raise SystemExit(f"--workloads: unknown or disabled {sorted(unknown) or ['decode']}")
    report: dict = {"config": {k: v for k, v in vars(args).items()}, "options": options}
    for mode in args.modes.split(","):
        report[mode] = run_mode(mode == "on", args, options)
    if "off" in report and "on" in report:
        print_table(report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
