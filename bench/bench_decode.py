"""Decode time per output token of the engine, side by side across attention backends and
KV-cache dtypes.

    python3 bench/bench_decode.py [--model PATH] [--device cuda] [--batch-sizes 1 8 32]

For each batch size, `bs` greedy requests with a fixed prompt length decode `--new-tokens`
tokens; TPOT = decode wall time / decode steps (prefill excluded: the first step's time is
measured separately). One engine per (backend, KV dtype) lives in this process on the same model; the
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
from mlaserve.kernels_adapter.flashmla import flashmla_available


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
    ap.add_argument(
        "--attention-backends",
        nargs="+",
        default=None,
        help="default: reference, plus flashmla on an SM90 GPU with sgl-flash-mla installed",
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    backends = args.attention_backends or ["reference"]
    if args.attention_backends is None and args.device.startswith("cuda") and flashmla_available():
        backends.append("flashmla")

    configs = [(b, kv) for b in backends for kv in args.kv_cache_dtypes]
    llms = {
        (b, kv): LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=kv,
            attention_backend=b,
            max_num_seqs=max(args.batch_sizes),
        )
        for b, kv in configs
    }
    for llm in llms.values():
        llm.engine.warmup()
        measure(llm, max(args.batch_sizes), args.prompt_len, 4, args.device)  # first-use costs
    samples: dict[tuple[str, str, int], list[dict]] = {}
    for _ in range(args.repeats):
        for bs in args.batch_sizes:
            for (b, kv), llm in llms.items():
                m = measure(llm, bs, args.prompt_len, args.new_tokens, args.device)
                samples.setdefault((b, kv, bs), []).append(m)
    rows = [
        {
            "attention_backend": b,
            "kv_cache_dtype": kv,
            "bs": bs,
            "prefill_ms": statistics.median(m["prefill_ms"] for m in ms),
            "tpot_ms": statistics.median(m["tpot_ms"] for m in ms),
            "tpot_ms_min_max": [min(m["tpot_ms"] for m in ms), max(m["tpot_ms"] for m in ms)],
        }
        for (b, kv, bs), ms in samples.items()
    ]
    rows.sort(key=lambda r: (configs.index((r["attention_backend"], r["kv_cache_dtype"])), r["bs"]))
    base_name = f"{configs[0][0]}/{configs[0][1]}"
    base = {r["bs"]: r["tpot_ms"] for r in rows[: len(args.batch_sizes)]}
    for r in rows:
        r["tpot_ratio_vs_base"] = r["tpot_ms"] / base[r["bs"]]

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"device: {device_name}  prompt_len={args.prompt_len} new_tokens={args.new_tokens}  "
        f"median of {args.repeats} rounds; range = min..max; ratio = TPOT / {base_name} TPOT"
    )
    print(
        f"{'backend':>10} {'kv_cache':>9} {'bs':>4} {'prefill ms':>11} {'TPOT ms':>9} "
        f"{'TPOT range':>13} {'ratio':>6}"
    )
    for r in rows:
        lo, hi = r["tpot_ms_min_max"]
        print(
            f"{r['attention_backend']:>10} {r['kv_cache_dtype']:>9} {r['bs']:>4} "
            f"{r['prefill_ms']:>11.2f} {r['tpot_ms']:>9.3f} {f'{lo:.2f}..{hi:.2f}':>13} "
            f"{r['tpot_ratio_vs_base']:>6.2f}"
        )
    print(json.dumps({"bench": "decode", "device": device_name, "base": base_name, "rows": rows}))


if __name__ == "__main__":
    main()
