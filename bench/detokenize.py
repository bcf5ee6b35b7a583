"""Per-token cost of incremental detokenization: tokenizers' DecodeStream vs the Python window.

    python3 bench/detokenize.py [--tokenizer PATH] [--tokens 20000] [--rounds 5]

Detokenizes one long generation (the repository's Python sources, encoded: code, prose and
non-ASCII text) token by token with both paths of `IncrementalDetokenizer`, from a fresh
detokenizer per round, and reports the median microseconds per token and whether both gave the
same text (they must: tests/tokenizer check it step by step). Prints a table and one JSON line.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mlaserve.config import default_model_path
from mlaserve.tokenizer import IncrementalDetokenizer, Tokenizer

PATHS = {"decode_stream": True, "python_window": False}


def corpus(num_tokens: int, tok: Tokenizer) -> list[int]:
    root = Path(__file__).resolve().parent.parent
    texts = [p.read_text(encoding="utf-8") for p in sorted(root.glob("mlaserve/**/*.py"))]
    texts.append(" héllo wörld 你好 🙂 naïve crème brûlée " * 50)
    ids = [i for text in texts for i in tok.encode(text, add_special_tokens=False)]
    while len(ids) < num_tokens:
        ids += ids
    return ids[:num_tokens]


def run(tok: Tokenizer, prompt: list[int], ids: list[int], stream: bool) -> tuple[float, str]:
    det = IncrementalDetokenizer(tok, prompt, use_decode_stream=stream)
    step = det.step
    t0 = time.perf_counter()
    for token in ids:
        step((token,))
    det.flush()
    return (time.perf_counter() - t0) / len(ids) * 1e6, det.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=str(default_model_path()))
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tok = Tokenizer.from_pretrained(args.tokenizer)
    ids = corpus(args.tokens + 8, tok)
    prompt, ids = ids[:8], ids[8:]
    us: dict[str, list[float]] = {name: [] for name in PATHS}
    texts: dict[str, str] = {}
    for _ in range(args.rounds):  # interleaved, so drift hits both paths alike
        for name, stream in PATHS.items():
            t, texts[name] = run(tok, prompt, ids, stream)
            us[name].append(t)
    same = texts["decode_stream"] == texts["python_window"] == tok.decode(ids)
    rows = {name: round(statistics.median(v), 3) for name, v in us.items()}
    print(f"incremental detokenization, {len(ids)} tokens, tokenizer {args.tokenizer}")
    for name, t in rows.items():
        print(f"  {name:<15}{t:>8.3f} us/token")
    print(f"  speed-up {rows['python_window'] / rows['decode_stream']:.1f}x, same text: {same}")
    print(json.dumps({"bench": "detokenize", "tokens": len(ids), "us_per_token": rows,
                      "same_text": same}))  # fmt: skip


if __name__ == "__main__":
    main()
