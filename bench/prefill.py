"""Time to first token of prompts against the compute floor, through the real engine loop.

    python3 bench/prefill.py --model /tmp/v2lite        # bench/make_checkpoint.py's V2-Lite shape
    python3 bench/prefill.py --attention-backend reference   # the fp32 latent-form EXTEND path

Cases: one prompt of 512, 2048 and 8192 tokens, and 8 concurrent 2048-token prompts. Each is
submitted to an idle engine and stepped (`LLMEngine.step()`, one sampled token) until every
prompt has its first token; TTFT is wall time from submission to the step that returned it
(the step reads the tokens back, so the GPU work is done). `--rounds` repetitions with fresh
random prompts; medians are reported. `max_num_batched_tokens` (`--max-batched-tokens`, default
8192) decides how many forwards a case takes: the 8 x 2048 case runs as two 8192-token forwards.

Floor: FLOPs over the bf16 matmul rate measured in this run (an 8192^3 bf16 GEMM on random data):
  2 x active params x prompt tokens (every parameter but the embedding table and the LM head,
  routed experts counted num_experts_per_tok / n_routed_experts of the way), + 2 x LM-head params
  per prompt (only its last token gets logits), + causal attention in the MHA form:
  2 x heads x (qk_head_dim + v_head_dim) x L (L + 1) / 2 per layer and prompt.
For the concurrent case the floor is the whole batch's, compared with the last TTFT.

Every case runs with piecewise CUDA graphs (`--piecewise-max-tokens`, default 8192: every case's
forwards replay from captured pieces, attention eager between them; a step of one fresh prompt
replays its bucket's one-graph forward, attention inside, where the backend captures it) and
eagerly, rounds interleaved, in one process; `graph/eager` is their TTFT ratio. With one-graph
prefills on, a third mode runs the same graphs with them off (`pieces`: every step piecewise)
and `graph/pieces` is the one-graph forward's gain.

`--profile`: torch.profiler over one 2048-token prefill (piecewise), top kernels by GPU time.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from mlaserve import LLM, SamplingParams

CASES = {"1x512": (1, 512), "1x2048": (1, 2048), "1x8192": (1, 8192), "8x2048": (8, 2048)}


def matmul_rate(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of a bf16 n^3 GEMM on random data (median of 10, CUDA events)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(times)


def flop_model(llm: LLM) -> tuple[float, float, float]:
    """(active params per prompt token, LM-head params, attention FLOPs per layer per L(L+1)/2)."""
    model, mc = llm.engine.runner.model, llm.engine.model_config
    per_token = lm_head = 0.0
    frac = mc.num_experts_per_tok / mc.n_routed_experts if mc.n_routed_experts else 0.0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or "embed_tokens" in name:
            continue
        if name.startswith("lm_head"):
            lm_head += p.numel()
        elif ".experts." in name:
            per_token += p.numel() * frac
        else:
            per_token += p.numel()
    attn = 2 * mc.num_attention_heads * (mc.qk_head_dim + mc.v_head_dim)
    return per_token, lm_head, attn


def floor_ms(llm: LLM, n: int, length: int, rate: float) -> float:
    per_token, lm_head, attn = flop_model(llm)
    layers = llm.engine.model_config.num_hidden_layers
    flops = n * (2 * per_token * length + 2 * lm_head + attn * layers * length * (length + 1) / 2)
    return flops / rate * 1e3


def run_case(llm: LLM, n: int, length: int, rng: random.Random, tag: str) -> list[float]:
    """TTFT (ms) of each of `n` concurrent `length`-token prompts, in submission order."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(n)]
    # the client's prompts exist before they are submitted: drawing 2048 random ids in Python
    # takes ~1 ms, which is not the server's time to first token
    prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in ids]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    ttft: dict[str, float] = {}
    while len(ttft) < n:
        for out in engine.step():
            if out.request_id in ids and out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = (time.perf_counter() - t0) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return [ttft[r] for r in ids]


def profile(llm: LLM, length: int, rng: random.Random, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_case(llm, 1, length, rng, "profile")
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [
        {
            "kernel": e.key[:90],
            "ms": e.self_device_time_total / 1e3,
            "calls": e.count,
            "share": e.self_device_time_total / total,
        }
        for e in events[:top]
    ] + [
        {"kernel": "TOTAL", "ms": total / 1e3, "calls": sum(e.count for e in events), "share": 1.0}
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: shipped model)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--profile", action="store_true", help="top kernels of a 2048-token prefill")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--piecewise-max-tokens", type=int, default=8192)
    args = ap.parse_args()
    device = torch.device("cuda")
    rate = matmul_rate(device)
    longest = max(CASES[c][1] for c in args.cases)
    llm = LLM(
        args.model,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        max_num_seqs=16,
        max_model_len=longest + 16,
        max_num_batched_tokens=args.max_batched_tokens,
        cuda_graph_batch_sizes=(1,),  # decode graphs are not what this measures
        piecewise_cuda_graph_max_tokens=args.piecewise_max_tokens,
        # a full prefill is what is timed: no prompt may find cached pages (the cached-prefix
        # prefill is bench/prefix_prefill.py's)
        enable_prefix_caching=False,
    )
    engine, rng = llm.engine, random.Random(0)
    piecewise = engine.graphs.piecewise
    report = engine.graph_report.piecewise
    one_graph = piecewise.one_graph
    # mode -> (piecewise graphs on, one-graph fresh prompts on)
    modes = {"graph": (True, one_graph), "eager": (False, False)}
    if one_graph:
        modes["pieces"] = (True, False)
    rows = []
    for name in args.cases:
        n, length = CASES[name]
        runs: dict[str, list[list[float]]] = {m: [] for m in modes}
        for r in range(args.rounds + 1):  # the first round of each mode is a warm-up
            for mode, (graphed, whole) in modes.items():
                piecewise.enabled, piecewise.one_graph = graphed, whole
                runs[mode].append(run_case(llm, n, length, rng, f"{name}-{mode}-{r}"))
        piecewise.enabled, piecewise.one_graph = True, one_graph
        row = {"case": name, "floor_ms": floor_ms(llm, n, length, rate)}
        for key in modes:
            done = runs[key][1:]
            row[f"{key}_ttft_ms"] = statistics.median(statistics.mean(t) for t in done)
            row[f"{key}_last_ms"] = statistics.median(max(t) for t in done)
            row[f"{key}_vs_floor"] = row[f"{key}_last_ms"] / row["floor_ms"]
        row["graph_vs_eager"] = row["graph_last_ms"] / row["eager_last_ms"]
        if one_graph:
            row["graph_vs_pieces"] = row["graph_last_ms"] / row["pieces_last_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    prof = profile(llm, 2048, rng, args.top) if args.profile else []
    backend = engine.runner.attn_backend.name
    name = args.model or "default-model"
    print(
        f"\ndevice: {torch.cuda.get_device_name()}  model: {name}  KV {args.kv_cache_dtype}  "
        f"backend {backend}  bf16 matmul {rate / 1e12:.0f} TFLOP/s  "
        f"max_num_batched_tokens {args.max_batched_tokens}\npiecewise graphs: buckets "
        f"{report.buckets}, {report.num_graphs} pieces, warm-up {report.warmup_s:.2f} s, "
        f"capture {report.capture_s:.2f} s, pool {report.pool_bytes / 2**20:.0f} MiB, "
        f"one-graph fresh prompts in {len(report.one_graph_buckets)} buckets, compiles while "
        f"serving {engine.compile_watch.compiles_since_ready}"
    )
    print("TTFT of the last prompt of a case (median over rounds), graph = piecewise graphs")
    extra = f" {'pieces ms':>9} {'graph/pieces':>12}" if one_graph else ""
    print(
        f"{'case':<8} {'floor ms':>9} {'graph ms':>9} {'eager ms':>9} {'graph/fl':>9} "
        f"{'eager/fl':>9} {'graph/eager':>11}{extra}"
    )
    for r in rows:
        extra = f" {r['pieces_last_ms']:>9.1f} {r['graph_vs_pieces']:>12.2f}" if one_graph else ""
        print(
            f"{r['case']:<8} {r['floor_ms']:>9.1f} {r['graph_last_ms']:>9.1f} "
            f"{r['eager_last_ms']:>9.1f} {r['graph_vs_floor']:>9.2f} {r['eager_vs_floor']:>9.2f} "
            f"{r['graph_vs_eager']:>11.2f}{extra}"
        )
    if prof:
        print("\ntop kernels, one 2048-token prefill (GPU time)")
        for p in prof:
            calls = "" if p["calls"] is None else p["calls"]
            print(f"{p['ms']:>8.2f} ms {p['share']:>6.1%} {calls:>6}  {p['kernel']}")
    print(
        json.dumps(
            {
                "bench": "prefill",
                "device": torch.cuda.get_device_name(),
                "model": name,
                "kv_cache_dtype": args.kv_cache_dtype,
                "backend": backend,
                "matmul_tflops": rate / 1e12,
                "max_num_batched_tokens": args.max_batched_tokens,
                "piecewise_buckets": list(report.buckets),
                "rows": rows,
                "profile": prof,
            }
        )
    )


if __name__ == "__main__":
    main()
