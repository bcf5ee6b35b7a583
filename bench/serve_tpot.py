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


def client_tpot_ms(model: str | None, tokens: int, rounds: int) -> dict[str, list[float]]:
    """Per-token time seen by two streaming clients of the same server: the official `openai`
    client (pydantic-parses every chunk), and a lean SSE reader on httpx (what arrives on the
    wire). TPOT = (last token's arrival - first's) / (tokens - 1), tokens from the final usage
    chunk, so a chunk that carries several tokens is counted as such."""
    import httpx
    import openai

    proc = start_server(
        Path(model) if model else None, Path("/tmp/serve_tpot.log"), "--device", "cuda"
    )
    body = {
        "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    try:
        proc.wait_ready(timeout=600)
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        results: dict[str, list[float]] = {"openai": [], "sse": []}
        for i in range(rounds + 1):
            stamps, n = [], 0
            stream = client.completions.create(
                model=name, **{k: v for k, v in body.items() if k not in ("ignore_eos", "stream")},
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    stamps.append(time.perf_counter())
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
            if i:  # the first round warms the connection
                results["openai"].append((stamps[-1] - stamps[0]) / (n - 1) * 1e3)
            stamps, n = [], 0
            with httpx.stream("POST", f"{proc.url}/v1/completions", json={**body, "model": name},
                              timeout=60) as response:  # fmt: skip
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if '"text":""' not in line.replace(" ", "") and '"choices":[]' not in line:
                        stamps.append(time.perf_counter())
                    if '"usage":{' in line.replace(" ", ""):
                        n = json.loads(line[6:])["usage"]["completion_tokens"]
            if i:
                results["sse"].append((stamps[-1] - stamps[0]) / (n - 1) * 1e3)
        return results
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    step = engine_step_ms(args.model, args.tokens)
    clients = client_tpot_ms(args.model, args.tokens, args.rounds)
    tpot = {k: statistics.median(v) for k, v in clients.items()}
    row = {
        "bench": "serve_tpot",
        "device": torch.cuda.get_device_name(),
        "model": args.model or "default-model",
        "engine_step_ms": step,
        "client_tpot_ms": tpot,
        "client_tpot_ms_all": clients,
        "ratio": {k: v / step for k, v in tpot.items()},
    }
    print(f"{'client':>8} {'engine step ms':>15} {'client TPOT ms':>15} {'ratio':>6}")
    for k, v in tpot.items():
        print(f"{k:>8} {step:>15.3f} {v:>15.3f} {v / step:>6.3f}")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
