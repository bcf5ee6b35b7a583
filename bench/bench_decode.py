"""Decode time per output token of the engine, side by side across KV-cache dtypes.

    python3 bench/bench_decode.py [--model PATH] [--device cuda] [--batch-sizes 1 8 32]

For each batch size, `bs` greedy requests with a fixed prompt length decode `--new-tokens`
tokens; TPOT = decode wall time / decode steps (prefill excluded: the first step's time is
measured separately). One engine per KV dtype lives in this process on the same model; the
configurations are measured in turn, `--repeats` rounds, and each cell reports the median, so
the ratios are side by side and drift hits every configuration alike. Prints a table and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mlaserve import LLM, SamplingParams


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(llm: LLM, bs: int, prompt_len: int, new_tokens: int, device: str) -> dict:
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(bs):
        prompt = [(7 * i + 13 * j) % vocab for j in range(prompt_len)]
        engine.add_request(f"b{bs}-{i}", prompt, params)
    sync(device)
    t0 = time.perf_counter()
    engine.step()  # prefill (all prompts fit the token budget)
    sync(device)
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sync(device)
    t2 = time.perf_counter()
    return {"bs": bs, "prefill_ms": (t1 - t0) * 1e3, "tpot_ms": (t2 - t1) * 1e3 / max(steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: shipped model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["bf16", "fp8_e4m3"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    llms = {
        kv: LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=kv,
            max_num_seqs=max(args.batch_sizes),
        )
        for kv in args.kv_cache_dtypes
    }
    for llm in llms.values():
        llm.engine.warmup()
        measure(llm, max(args.batch_sizes), args.prompt_len, 4, args.device)  # first-use costs
    samples: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.repeats):
        for bs in args.batch_sizes:
            for kv, llm in llms.items():
                m = measure(llm, bs, args.prompt_len, args.new_tokens, args.device)
                samples.setdefault((kv, bs), []).append(m)
    rows = [
        {
            "kv_cache_dtype": kv,
            "bs": bs,
            "prefill_ms": statistics.median(m["prefill_ms"] for m in ms),
            "tpot_ms": statistics.median(m["tpot_ms"] for m in ms),
            "tpot_ms_min_max": [min(m["tpot_ms"] for m in ms), max(m["tpot_ms"] for m in ms)],
        }
        for (kv, bs), ms in samples.items()
    ]
    rows.sort(key=lambda r: (args.kv_cache_dtypes.index(r["kv_cache_dtype"]), r["bs"]))
    base = {r["bs"]: r["tpot_ms"] for r in rows if r["kv_cache_dtype"] == args.kv_cache_dtypes[0]}
    for r in rows:
        r["tpot_ratio_vs_" + args.kv_cache_dtypes[0]] = r["tpot_ms"] / base[r["bs"]]

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"device: {device_name}  backend: reference  prompt_len={args.prompt_len} "
        f"new_tokens={args.new_tokens}"
    )
    print(f"median of {args.repeats} rounds; TPOT range = min..max over rounds")
    print(
        f"{'kv_cache_dtype':>14} {'bs':>4} {'prefill ms':>11} {'TPOT ms':>9} "
        f"{'TPOT range':>15} {'ratio':>6}"
    )
    for r in rows:
        ratio = r["tpot_ratio_vs_" + args.kv_cache_dtypes[0]]
        lo, hi = r["tpot_ms_min_max"]
        print(
            f"{r['kv_cache_dtype']:>14} {r['bs']:>4} {r['prefill_ms']:>11.2f} "
            f"{r['tpot_ms']:>9.3f} {f'{lo:.2f}..{hi:.2f}':>15} {ratio:>6.2f}"
        )
    print(json.dumps({"bench": "decode", "device": device_name, "rows": rows}))


if __name__ == "__main__":
    main()
