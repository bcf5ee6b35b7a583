"""End to end: TPOT seen by a streaming client of the HTTP server vs the engine's own graphed
decode step, one request at a time (bs 1), on the GPU (or on the CPU with `--device cpu`, one
intra-op thread on both sides, to compare the service's per-token overhead between versions).

    python3 bench/serve_tpot.py [--model PATH] [--tokens 256] [--device cuda|cpu]

First the engine in this process: one request, wall time per decode step through
`LLMEngine.step()` (graphs on). Then `mlaserve serve` in a subprocess with the same settings and
the official `openai` client streaming a completion: TPOT = (last chunk - first chunk) /
(chunks - 1). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from mlaserve import LLM, SamplingParams
from tests.service.server_process import start_server

PROMPT = "import os\n\n\ndef walk(path):\n"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_step_ms(model: str | None, tokens: int, device: str) -> float:
    llm = LLM(model, device=device)
    engine = llm.engine
    engine.add_request(
        "e2e", PROMPT, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    )
    engine.step()  # prefill
    for _ in range(4):
        engine.step()
    _sync(device)
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        n += 1
    _sync(device)
    ms = (time.perf_counter() - t0) / n * 1e3
    del llm, engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return ms


def _loop_cpu_s(pid: int) -> float:
    """CPU time of a process's main thread (the server's event loop; Linux /proc)."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def client_tpot_ms(
    model: str | None, tokens: int, rounds: int, device: str
) -> dict[str, list[float]]:
    """Per-token time seen by two streaming clients of the same server: the official `openai`
    client (pydantic-parses every chunk), and a lean SSE reader on httpx (what arrives on the
    wire). TPOT = (last token's arrival - first's) / (tokens - 1), tokens from the final usage
    chunk, so a chunk that carries several tokens is counted as such. Also the CPU time of the
    server's event-loop thread per token during the lean client's rounds (`loop_cpu`): the
    HTTP side's own per-token work, insensitive to other load on the machine (clock-tick
    resolution, 10 ms per round); and the engine's own inter-token interval inside the server
    (`server_itl`, from `mlaserve:inter_token_latency_seconds`, the engine's timestamps), which
    tells the frontend's delay (client TPOT - server ITL) from the serving engine's step."""
    import httpx
    import openai

    proc = start_server(
        Path(model) if model else None, Path("/tmp/serve_tpot.log"), "--device", device
    )
    body = {
        "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    try:
        proc.wait_ready(timeout=600)
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        results: dict[str, list[float]] = {
            "openai": [],
            "sse": [],
            "loop_cpu": [],
            "server_itl": [],
        }
        itl = "mlaserve:inter_token_latency_seconds"
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
            cpu0 = _loop_cpu_s(proc.proc.pid)
            itl0 = proc.metric(f"{itl}_sum"), proc.metric(f"{itl}_count")
            with httpx.stream("POST", f"{proc.url}/v1/completions", json={**body, "model": name},
                              timeout=60) as response:  # fmt: skip
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if '"text":""' not in line.replace(" ", "") and '"choices":[]' not in line:
                        stamps.append(time.perf_counter())
                    if '"usage":{' in line.replace(" ", ""):
                        n = json.loads(line[6:])["usage"]["completion_tokens"]
            cpu = _loop_cpu_s(proc.proc.pid) - cpu0
            itl_sum = proc.metric(f"{itl}_sum") - itl0[0]
            itl_count = proc.metric(f"{itl}_count") - itl0[1]
            if i:
                results["server_itl"].append(itl_sum / max(itl_count, 1) * 1e3)
                results["sse"].append((stamps[-1] - stamps[0]) / (n - 1) * 1e3)
                results["loop_cpu"].append(cpu / n * 1e3)
        return results
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # as the server's (OMP_NUM_THREADS=1 in start_server)
    step = engine_step_ms(args.model, args.tokens, args.device)
    clients = client_tpot_ms(args.model, args.tokens, args.rounds, args.device)
    loop_cpu = statistics.median(clients.pop("loop_cpu"))
    server_itl = statistics.median(clients.pop("server_itl"))
    tpot = {k: statistics.median(v) for k, v in clients.items()}
    row = {
        "bench": "serve_tpot",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": args.model or "default-model",
        "engine_step_ms": step,
        "client_tpot_ms": tpot,
        "client_tpot_ms_all": clients,
        "ratio": {k: v / step for k, v in tpot.items()},
        "overhead_ms": {k: v - step for k, v in tpot.items()},
        "loop_cpu_ms_per_token": loop_cpu,
        "server_itl_ms": server_itl,
    }
    print(f"{'client':>8} {'engine step ms':>15} {'client TPOT ms':>15} {'ratio':>6} {'+ms':>7}")
    for k, v in tpot.items():
        print(f"{k:>8} {step:>15.3f} {v:>15.3f} {v / step:>6.3f} {v - step:>7.3f}")
    print(f"server event-loop CPU per token: {loop_cpu:.3f} ms")
    print(f"engine inter-token interval in the server: {server_itl:.3f} ms "
          f"(sse client TPOT / it: {tpot['sse'] / server_itl:.3f})")  # fmt: skip
    print(json.dumps(row))


if __name__ == "__main__":
    main()
