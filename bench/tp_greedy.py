"""Greedy agreement of tensor- and expert-parallel runs with TP1, on GPUs (issue 42).

    python3 bench/tp_greedy.py --model DIR [VARIANT ...] [--prompts 64] [--max-tokens 128]

Variants: tp1, tp2, ep2 (tp2 + --enable-expert-parallel), tp4, ep4. Every variant runs eagerly
(no CUDA graphs, no overlap: the sharding alone; bench/tp_agreement.py runs the served
configuration), in its own process (each starts its
ranks and frees its GPUs on exit), on the same prompts (bench/soak.py's word mix, 40 to
--prompt-bytes bytes) with the same fixed KV pool. Per variant against tp1: completions
identical token for token, where the others first part, and over the first 16 prompts the
prompt tokens' own logprobs |variant - tp1| (median, p99, max: the prefill logits' distance).
Load time is in the table; each rank's GB/s is in the variants' logs ("weights per rank").
Prints a table and a JSON line. Not a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS: dict[str, dict] = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "tp4": {"tensor_parallel_size": 4},
    "ep4": {"tensor_parallel_size": 4, "enable_expert_parallel": True},
}
EAGER = {"cuda_graph": False, "piecewise_cuda_graph": False, "overlap_schedule": False}


def prompts_for(seed: int, n: int, max_bytes: int) -> list[str]:
    from soak import _text  # the soak's prompt words

    rng = random.Random(seed)
    return [_text(rng, rng.randint(40, max_bytes)) for _ in range(n)]


def run_one(args: argparse.Namespace) -> None:
    """Child process: one variant; writes its token ids and prompt logprobs to --out."""
    from mlaserve import LLM, SamplingParams

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for name in ("mlaserve.engine.model_runner", "mlaserve.model.loader"):  # the GB/s lines
        logging.getLogger(name).setLevel(logging.INFO)
    t0 = time.time()
    # cache off: the greedy run prefills its prompts, not the scored run's cached pages
    llm = LLM(args.model, num_pages=args.num_pages, enable_prefix_caching=False, **EAGER,
              **VARIANTS[args.run])  # fmt: skip
    loaded = time.time() - t0
    prompts = prompts_for(args.seed, args.prompts, args.prompt_bytes)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    lps = []
    for out in llm.generate(prompts[:16], scored, use_tqdm=False):
        pairs = zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
        lps.append([None if e is None else e[t].logprob for t, e in pairs])
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    t1 = time.time()
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    gen = time.time() - t1
    ids = [list(o.outputs[0].token_ids) for o in outs]
    llm.shutdown()
    Path(args.out).write_text(
        json.dumps({"ids": ids, "lps": lps, "load_s": loaded, "generate_s": gen})
    )


def compare(ref: dict, got: dict) -> dict:
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        for a, b in zip(ref["ids"], got["ids"], strict=True)
    ]
    diffs = sorted(
        abs(x - y)
        for a, b in zip(ref["lps"], got["lps"], strict=True)
        for x, y in zip(a, b, strict=True)
        if x is not None and y is not None
    )
    n = len(diffs)
    return {
        "identical": sum(d is None for d in first),
        "of": len(first),
        "first_divergence": sorted(d for d in first if d is not None),
        "prompt_logprob_absdiff": {
            "p50": diffs[n // 2],
            "p99": diffs[int(n * 0.99)],
            "max": diffs[-1],
        },
        "load_s": round(got["load_s"], 1),
        "generate_s": round(got["generate_s"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", default=["tp1", "tp2", "ep2"], metavar="VARIANT")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-pages", type=int, default=2000, help="a fixed KV pool, no preemption")
    ap.add_argument("--prompt-bytes", type=int, default=2000, help="longest prompt, in bytes")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--run", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run_one(args)
        return
    variants = ["tp1", *[v for v in args.variants if v != "tp1"]]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, "--model", args.model, "--run", name, "--out", out]
            cmd += ["--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)]
            cmd += ["--num-pages", str(args.num_pages), "--seed", str(args.seed)]
            cmd += ["--prompt-bytes", str(args.prompt_bytes)]
            proc = subprocess.run([str(c) for c in cmd], check=False)
            if proc.returncode:
                results[name] = {"error": f"exit code {proc.returncode}"}
                continue
            results[name] = json.loads(out.read_text())
    ref = results["tp1"]
    rows = []
    print(
        f"{'variant':>7} {'identical':>10} {'lp p50':>8} {'lp p99':>8} {'lp max':>8} {'load s':>7}"
    )
    for name in variants:
        got = results[name]
        if "error" in got or "error" in ref:
            rows.append({"variant": name, "error": got.get("error") or ref.get("error")})
            print(f"{name:>7} error: {rows[-1]['error']}")
            continue
        row = {"variant": name, **compare(ref, got)}
        lp = row["prompt_logprob_absdiff"]
        print(
            f"{name:>7} {row['identical']:>5}/{row['of']:<4} {lp['p50']:8.2g} {lp['p99']:8.2g}"
            f" {lp['max']:8.2g} {row['load_s']:7.1f}"
        )
        rows.append(row)
    print(json.dumps({"bench": "tp_greedy", "model": args.model, "seed": args.seed, "rows": rows}))


if __name__ == "__main__":
    main()
