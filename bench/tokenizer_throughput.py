"""Tokenizer throughput for text prompts: how fast the server's tokenizer thread drains a burst.

    python3 bench/tokenizer_throughput.py [--tokenizer PATH] [--tokens 1000] [--prompts 512]

Every text prompt is encoded on one tokenizer thread (`TokenizerWorker`) before admission, so a
burst of requests waits there first; this says for how long. The prompts are distinct windows of
`--tokens` tokens of the repository's sources and docs (code and prose), decoded back to text.
Three ways, each over the same prompts, best of `--rounds`:

    encode       `Tokenizer.encode` in a loop on one thread (the worker's work alone)
    worker       the same through `TokenizerWorker.run`, all prompts submitted at once from an
                 event loop (adds the thread hop and the loop's bookkeeping per job)
    encode_batch the HF tokenizer's batch call (Rust threads over the batch), for comparison

Prints a table and one JSON line. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import transformers

from mlaserve.config import default_model_path
from mlaserve.service.tokenizer_worker import TokenizerWorker
from mlaserve.tokenizer import Tokenizer


def prompts(tok: Tokenizer, num_tokens: int, count: int) -> list[str]:
    root = Path(__file__).resolve().parent.parent
    files = sorted([*root.glob("mlaserve/**/*.py"), *root.glob("docs/*.md"), root / "README.md"])
    ids = [i for p in files for i in tok.encode(p.read_text(encoding="utf-8"), False)]
    if len(ids) < num_tokens:
        raise SystemExit(f"the corpus has only {len(ids)} tokens; ask for fewer")
    # Windows at a stride that spreads `count` of them over the corpus (wrapping when short).
    stride = max(1, (len(ids) - num_tokens) // count)
    starts = [(k * stride) % (len(ids) - num_tokens + 1) for k in range(count)]
    return [tok.decode(ids[s : s + num_tokens]) for s in starts]


def time_encode(tok: Tokenizer, texts: list[str]) -> float:
    t0 = time.perf_counter()
    for text in texts:
        tok.encode(text)
    return time.perf_counter() - t0


def time_worker(tok: Tokenizer, texts: list[str]) -> float:
    async def burst() -> float:
        worker = TokenizerWorker(max_pending=len(texts))
        worker.bind(tok)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker.run(lambda t, x=x: t.encode(x)) for x in texts))
        elapsed = time.perf_counter() - t0
        worker.shutdown()
        return elapsed

    return asyncio.run(burst())


def time_encode_batch(tok: Tokenizer, texts: list[str]) -> float:
    t0 = time.perf_counter()
    tok.hf(texts)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=str(default_model_path()))
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per prompt")
    parser.add_argument("--prompts", type=int, default=512, help="prompts per burst")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()  # the corpus files are longer than the model
    tok = Tokenizer.from_pretrained(args.tokenizer)
    texts = prompts(tok, args.tokens, args.prompts)
    mean_tokens = sum(len(tok.encode(t)) for t in texts) / len(texts)
    ways = {"encode": time_encode, "worker": time_worker, "encode_batch": time_encode_batch}
    best = {name: min(fn(tok, texts) for _ in range(args.rounds)) for name, fn in ways.items()}
    rate = {name: round(len(texts) / s, 1) for name, s in best.items()}
    cpus = len(os.sched_getaffinity(0))
    print(f"tokenizer {args.tokenizer}: {len(texts)} text prompts of {mean_tokens:.0f} tokens "
          f"(mean), best of {args.rounds}, {cpus} CPUs")  # fmt: skip
    print(f"  {'way':<14}{'prompts/s':>11}{'tokens/s':>12}{'ms/prompt':>11}")
    for name, r in rate.items():
        print(f"  {name:<14}{r:>11.0f}{r * mean_tokens:>12.0f}{1e3 / r:>11.2f}")
    print(json.dumps({"bench": "tokenizer_throughput", "prompts": len(texts),
                      "mean_tokens": round(mean_tokens, 1), "cpus": cpus,
                      "prompts_per_s": rate}))  # fmt: skip


if __name__ == "__main__":
    main()
