"""End to end: TPOT seen by a streaming client of the HTTP server vs the engine's own graphed
decode step, one request at a time (bs 1), on the GPU.

    python3 bench/serve_tpot.py [--model PATH] [--tokens 256]

First the engine in this process: one request, wall time per decode step through
`LLMEngine.step()` (graphs on). Then `mlaserve serve` in a subprocess with the same settings and
the official `openai` client streaming a completion: TPOT = (last chunk - first chunk) /
(chunks - 1). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlaserve import LLM, SamplingParams
from tests.service.server_process import start_server

PROMPT = "import os\n\n\ndef walk(path):\n"


def engine_step_ms(model: str | None, tokens: int) -> float:
    llm = LLM(model)
    engine = llm.engine
    engine.add_request(
        "e2e", PROMPT, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    )
    engine.step()  # prefill
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / n * 1e3
    del llm, engine
    torch.cuda.empty_cache()
    return ms


def client_tpot_ms(model: str | None, tokens: int, rounds: int) -> list[float]:
    import openai

    proc = start_server(
        Path(model) if model else None, Path("/tmp/serve_tpot.log"), "--device", "cuda"
    )
    try:
        proc.wait_ready(timeout=600)
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        results = []
        for _ in range(rounds + 1):
            stamps = []
            stream = client.completions.create(
                model=name, prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    stamps.append(time.perf_counter())
            results.append((stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3)
        return results[1:]  # the first round warms the client's connection
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    step = engine_step_ms(args.model, args.tokens)
    client = client_tpot_ms(args.model, args.tokens, args.rounds)
    tpot = statistics.median(client)
    row = {
        "bench": "serve_tpot",
        "device": torch.cuda.get_device_name(),
        "model": args.model or "default-model",
        "engine_step_ms": step,
        "client_tpot_ms": tpot,
        "client_tpot_ms_all": client,
        "ratio": tpot / step,
    }
    print(f"{'engine step ms':>15} {'client TPOT ms':>15} {'ratio':>6}")
    print(f"{step:>15.3f} {tpot:>15.3f} {tpot / step:>6.3f}")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
