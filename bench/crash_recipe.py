"""Issue 40's crash recipe against a live `mlaserve serve` (the server died on a GPU under it).

    python3 bench/crash_recipe.py [--seed S] [--model PATH] [ENGINE OPTIONS ...]
    python3 bench/crash_recipe.py --url http://127.0.0.1:8000
    python3 bench/crash_recipe.py --requests 16 --prompt-min 16 --prompt-max 128 \\
        --output-tokens 16 --concurrency 8 --late-streams 4 --late-prompt 32 --max-model-len 256

Phase 1: --requests (256) streaming completions of random token-id prompts of --prompt-min to
--prompt-max (256-2048) tokens, --output-tokens (256) each with ignore_eos, --concurrency (64) at
a time. Phase 2, once phase 1 is over: --late-streams (8) streaming requests of --late-prompt
(512) tokens and, at the same moment, one request of max_model_len - --margin (16) prompt tokens
with max_tokens --margin. The server is started as bench/soak.py starts it (default settings,
plus any option this script does not know), or attached with --url (loopback only). Prints per
phase the ok / failed counts, the statuses and /health, then a JSON line; exit code 1 on any
5xx, error event in a stream, lost request, or a dead server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.soak import Outcome, Planned, Target, http_client, is_loopback, log_problems, send

# Outcomes that fail the recipe: what the GPU server did (5xx, errors mid-stream, dropped
# connections). A 4xx is reported but is the server refusing, not dying.
FATAL = ("5xx", "stream_error", "transport_error", "truncated")


def _stream_body(rng: random.Random, prompt_len: int, max_tokens: int, vocab: int) -> dict:
    return {
        "prompt": [rng.randrange(3, vocab) for _ in range(prompt_len)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _kind(o: Outcome) -> str:
    if o.status is None:
        return "transport_error"
    if o.status >= 500:
        return "5xx"
    if o.stream_error is not None:
        return "stream_error"
    if o.status != 200:
        return "4xx"
    return "ok" if o.complete else "truncated"


async def _phases(url: str, args: argparse.Namespace, max_model_len: int, vocab: int) -> list:
    rng = random.Random(args.seed)
    first = [
        Planned(i, "completions", body, ("phase1",))
        for i in range(args.requests)
        for body in [
            _stream_body(rng, rng.randint(args.prompt_min, args.prompt_max),
                         args.output_tokens, vocab)
        ]
    ]  # fmt: skip
    late = [
        Planned(args.requests + i, "completions",
                _stream_body(rng, args.late_prompt, args.output_tokens, vocab), ("late",))
        for i in range(args.late_streams)
    ]  # fmt: skip
    long_body = _stream_body(rng, max_model_len - args.margin, args.margin, vocab)
    late.append(Planned(args.requests + args.late_streams, "completions", long_body, ("long",)))
    gate = asyncio.Semaphore(args.concurrency)

    async def bounded(item: Planned) -> Outcome:
        async with gate:
            return await send(client, item)

    async with http_client(url, args.request_timeout_s, args.concurrency + len(late) + 4) as client:
        t0 = time.perf_counter()
        one = await asyncio.gather(*(bounded(item) for item in first))
        t1 = time.perf_counter()
        two = await asyncio.gather(*(send(client, item) for item in late))
        t2 = time.perf_counter()
    return [(one, t1 - t0), (two, t2 - t1)]


def _speed(outcomes: list[Outcome], wall_s: float) -> dict:
    """A phase's serving figures: output tokens per second of wall time, and the p50 / p90 of
    the streams' TPOT and TTFT (ms) over the requests that completed."""
    done = [o for o in outcomes if _kind(o) == "ok"]
    tokens = sum(o.completion_tokens or 0 for o in done)

    def pct(values: list[float], q: float) -> float | None:
        values = sorted(values)
        return (
            round(1e3 * values[min(len(values) - 1, int(q * len(values)))], 2) if values else None
        )

    tpot = [o.tpot_s for o in done if o.tpot_s is not None]
    ttft = [o.ttft_s for o in done if o.ttft_s is not None]
    return {
        "wall_s": round(wall_s, 2), "output_tokens": tokens,
        "output_tok_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "tpot_p50_ms": pct(tpot, 0.5), "tpot_p90_ms": pct(tpot, 0.9),
        "ttft_p50_ms": pct(ttft, 0.5), "ttft_p90_ms": pct(ttft, 0.9),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Any other option goes to `mlaserve serve`.",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default=None, help="attach to this loopback server instead")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the shipped one)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=256)
    ap.add_argument("--prompt-max", type=int, default=2048)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--late-streams", type=int, default=8)
    ap.add_argument("--late-prompt", type=int, default=512)
    ap.add_argument("--margin", type=int, default=16, help="the long request's room to generate")
    ap.add_argument("--request-timeout-s", type=float, default=900.0)
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    ap.add_argument("--server-log", default=None)
    args, options = ap.parse_known_args(argv)
    if args.url and not is_loopback(args.url):
        ap.error(f"--url must be a loopback address, not {args.url}")
    if args.url:
        log = Path(args.server_log) if args.server_log else None
        target = Target(args.url.rstrip("/"), None, log)
    else:
        log = Path(args.server_log or f"/tmp/crash-recipe-server-{args.seed}.log")
        target = Target.start(args.model, log, options, args.startup_timeout_s)
    try:
        info = target.model()
        config = Path(info.get("root") or "") / "config.json"
        vocab = json.loads(config.read_text())["vocab_size"] if config.is_file() else 4096
        phases = asyncio.run(_phases(target.url, args, info["max_model_len"], vocab))
        health = target.health()
        alive = target.alive()
    finally:
        exit_code = target.stop()
    tracebacks, excerpt = log_problems(target.log())

    names = [
        f"1: {args.requests} x {args.prompt_min}-{args.prompt_max} tok, {args.concurrency} at once",
        f"2: {args.late_streams} x {args.late_prompt} tok + 1 x {info['max_model_len'] - args.margin}",
    ]
    rows = []
    for name, (outcomes, wall_s) in zip(names, phases):
        kinds = Counter(_kind(o) for o in outcomes)
        statuses = Counter(str(o.status) for o in outcomes)
        rows.append({
            "phase": name, "sent": len(outcomes), "ok": kinds["ok"],
            "failed": len(outcomes) - kinds["ok"], "outcomes": dict(kinds),
            "statuses": dict(statuses),
            "errors": sorted({o.stream_error or o.error for o in outcomes
                              if _kind(o) != "ok"} - {None})[:10],
            **_speed(outcomes, wall_s),
        })  # fmt: skip
    fatal = sum(r["outcomes"].get(k, 0) for r in rows for k in FATAL)
    ok = fatal == 0 and alive and health == 200 and tracebacks == 0
    print(f"{'phase':<52} {'sent':>5} {'ok':>5} {'failed':>6} {'out tok/s':>10} "
          f"{'TPOT p50/p90 ms':>16} {'TTFT p50 ms':>12}  statuses")  # fmt: skip
    for r in rows:
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
        tpot = f"{r['tpot_p50_ms']}/{r['tpot_p90_ms']}"
        print(f"{r['phase']:<52} {r['sent']:>5} {r['ok']:>5} {r['failed']:>6} "
              f"{r['output_tok_s'] or 0:>10.1f} {tpot:>16} {r['ttft_p50_ms'] or 0:>12.1f}  "
              f"{statuses}")  # fmt: skip
        for error in r["errors"]:
            print(f"    {error}")
    print(f"/health after: {health}; server alive: {alive}; exit code on SIGTERM: {exit_code}; "
          f"tracebacks in its log: {tracebacks}")  # fmt: skip
    for line in excerpt:
        print(f"    {line}")
    print(json.dumps({
        "bench": "crash_recipe", "seed": args.seed, "server_options": options,
        "max_model_len": info["max_model_len"], "phases": rows, "health": health,
        "alive": alive, "exit_code": exit_code, "log_tracebacks": tracebacks,
        "log_excerpt": excerpt, "ok": ok,
    }))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
