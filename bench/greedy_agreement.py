"""Greedy agreement, alone vs all at once, offline, by engine variant (issue 40).

    python3 bench/greedy_agreement.py [VARIANT ...] [--prompts 48] [--max-tokens 128]

The same greedy prompts (bench/soak.py's word mix, 40-4000 bytes) run one at a time and then all
at once through `LLM.generate`. Per variant it reports how many completions are identical, where
the others first part, whether the batched run repeats itself exactly, and, over the first 16
prompts, how far the prompt tokens' own logprobs move between the two runs (|alone - batched|:
median, p99, max). A logic error that mixes requests moves logprobs in every dtype; kernels that
are not batch-invariant move them in bf16 and leave float32 within rounding. Prints a table and a
JSON line. Not a test.

Variants: default (the served configuration: bf16, FP8 KV, CUDA graphs), kv_bf16 (bf16 KV),
spec3 (MTP speculation, k = 3), eager (no CUDA graphs), fp32 (float32 weights and KV through the
reference attention backend, eager), deterministic (the batch-invariant mode,
`--enable-deterministic-inference`, otherwise the served configuration: expect 48/48 identical
and prompt-logprob differences of at most an ulp or so, from torch's logsumexp),
deterministic_spec3 (the same with MTP speculation, k = 3).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak import _text  # the soak's prompt words

from mlaserve import LLM, SamplingParams

VARIANTS: dict[str, dict] = {
    "default": {},
    "kv_bf16": {"kv_cache_dtype": "auto"},
    "spec3": {"num_speculative_tokens": 3},
    "eager": {"cuda_graph": False, "piecewise_cuda_graph": False},
    "deterministic": {"deterministic_inference": True},
    "deterministic_spec3": {"deterministic_inference": True, "num_speculative_tokens": 3},
    "fp32": {
        "dtype": "float32",
        "kv_cache_dtype": "auto",
        "attention_backend": "reference",
        "cuda_graph": False,
        "piecewise_cuda_graph": False,
    },
}


def prompt_logprobs(outputs) -> list[list[float | None]]:
    """Per prompt: each prompt token's own logprob (None for the first token)."""
    rows = []
    for out in outputs:
        pairs = zip(out.prompt_token_ids, out.prompt_logprobs)
        rows.append([None if entry is None else entry[t].logprob for t, entry in pairs])
    return rows


def run_variant(name: str, prompts: list[str], max_tokens: int, num_pages: int) -> dict:
    t0 = time.time()
    # Cache off: the batched run must prefill what the alone run did (with it on, the second
    # run of a prompt starts from the first's cached pages, another computation)
    llm = LLM(num_pages=num_pages, enable_prefix_caching=False, **VARIANTS[name])
    # The engine refuses prompt logprobs under speculation: those variants report no drift.
    speculative = "num_speculative_tokens" in VARIANTS[name]
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    few = [] if speculative else prompts[:16]
    alone_lp = prompt_logprobs([llm.generate([p], scored, use_tqdm=False)[0] for p in few])
    batch_lp = prompt_logprobs(llm.generate(few, scored, use_tqdm=False)) if few else []
    diffs = sorted(
        abs(x - y)
        for a, b in zip(alone_lp, batch_lp)
        for x, y in zip(a, b)
        if x is not None and y is not None
    )
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    def ids(outs):
        return [list(o.outputs[0].token_ids) for o in outs]

    alone = [ids(llm.generate([p], greedy, use_tqdm=False))[0] for p in prompts]
    together = ids(llm.generate(prompts, greedy, use_tqdm=False))
    again = ids(llm.generate(prompts, greedy, use_tqdm=False))
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        for a, b in zip(alone, together)
    ]
    del llm
    gc.collect()
    n = len(diffs)
    return {
        "variant": name,
        "identical": sum(d is None for d in first),
        "of": len(prompts),
        "batch_repeatable": sum(a == b for a, b in zip(together, again)),
        "first_divergence": sorted(d for d in first if d is not None),
        "prompt_logprob_absdiff": {
            "n": n,
            "p50": diffs[n // 2] if n else float("nan"),
            "p99": diffs[int(n * 0.99)] if n else float("nan"),
            "max": diffs[-1] if n else float("nan"),
        },
        "s": round(time.time() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", default=list(VARIANTS), metavar="VARIANT")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-pages", type=int, default=1200, help="a fixed KV pool, no preemption")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [_text(rng, rng.randint(40, 4000)) for _ in range(args.prompts)]
    rows = []
    print(
        f"{'variant':>19} {'identical':>10} {'repeatable':>10} {'lp p50':>8} {'lp p99':>8} {'lp max':>8}"
    )
    for name in args.variants:
        try:
            row = run_variant(name, prompts, args.max_tokens, args.num_pages)
        except Exception as e:  # a variant the device can't run (e.g. a backend) is reported
            row = {"variant": name, "error": repr(e)[:300]}
            print(f"{name:>19} error: {row['error']}")
        else:
            lp = row["prompt_logprob_absdiff"]
            print(
                f"{name:>19} {row['identical']:>5}/{row['of']:<4} {row['batch_repeatable']:>6}/{row['of']:<3}"
                f" {lp['p50']:8.2g} {lp['p99']:8.2g} {lp['max']:8.2g}"
            )
        rows.append(row)
    print(
        json.dumps(
            {
                "bench": "greedy_agreement",
                "seed": args.seed,
                "max_tokens": args.max_tokens,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
