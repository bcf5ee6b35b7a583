"""What compiling a structured request's grammar costs, and whether it holds the GIL.

    python3 bench/grammar_compile.py [--model PATH] [--properties 40] [--repeats 5]

Builds the engine's `GrammarBackend` (xgrammar's tokenizer tables: once per engine), then
compiles `--repeats` JSON schemas of `--properties` properties (distinct titles, so xgrammar's
cache does not answer) while a pure-Python thread spins, and compares the spinner's rate during
the compiles with its rate before them. A rate near 1 means the compile let the GIL go (a thread
compiling does not stall the engine loop); near 0, it held it. The engine process compiles on its
command thread for that reason (`service/engine_core.py`). Prints a table and one JSON line.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

# This checkout's package, not whatever an editable install elsewhere points at.
# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from mlaserve.config import EngineConfig
from mlaserve.engine.grammar import GrammarBackend
from mlaserve.sampling_params import StructuredOutputsParams
from mlaserve.tokenizer import Tokenizer


def schema(properties: int, title: str) -> dict:
    props = {
        f"f{i}": {"type": ["string", "integer", "array"], "items": {"type": "number"}}
        for i in range(properties)
    }
    return {"title": title, "type": "object", "properties": props}


class Spinner:
    """A pure-Python loop on its own thread; `rate()` is its iterations per second so far."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self._stop:
            self.count += 1

    def __enter__(self) -> Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()

    def rate_during(self, fn) -> tuple[float, float]:
        """(iterations per second while fn runs, fn's seconds)."""
        c0, t0 = self.count, time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        return (self.count - c0) / seconds, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    p.add_argument("--properties", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    path = args.model or EngineConfig().tokenizer_path
    tokenizer = Tokenizer.from_pretrained(path)
    vocab = len(tokenizer.hf)

    t0 = time.perf_counter()
    backend = GrammarBackend(tokenizer, vocab, [tokenizer.hf.eos_token_id or 0])
    init_s = time.perf_counter() - t0

    with Spinner() as spinner:
        idle, _ = spinner.rate_during(lambda: time.sleep(0.2))
        compile_s: list[float] = []

        def compile_all() -> None:
            for i in range(args.repeats):
                so = StructuredOutputsParams(json=schema(args.properties, f"bench-{i}"))
                c0 = time.perf_counter()
                backend.matcher(so)
                compile_s.append(time.perf_counter() - c0)

        busy, _ = spinner.rate_during(compile_all)

    ratio = busy / idle if idle else 0.0
    print(f"tokenizer {path} (vocab {vocab})")
    print("                              ms")
    print(f"backend init (tokenizer tables) {init_s * 1e3:9.1f}")
    for i, s in enumerate(compile_s):
        print(f"compile schema {i} ({args.properties} props)  {s * 1e3:9.1f}")
    print(f"spinner rate while compiling: {ratio:.2f} of its idle rate")
    record = {
        "bench": "grammar_compile",
        "vocab": vocab,
        "init_ms": round(init_s * 1e3, 2),
        "compile_ms": [round(s * 1e3, 2) for s in compile_s],
        "spinner_rate_ratio": round(ratio, 3),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
