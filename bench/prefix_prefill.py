"""The cached-prefix prefill (a few new tokens over thousands of cached ones) against its
compute-plus-bytes floor, through the real engine loop (issue 43's last criterion).

    python3 bench/prefix_prefill.py                        # V3-lite: --model /dev/shm/v3lite
    python3 bench/prefix_prefill.py --cached 8192 --new 16 64 256 --rounds 5
    python3 bench/prefix_prefill.py --device cpu --model '' --cached 48 --new 4 8 \\
        --page-size 16 --rounds 1                          # smoke test (tests/bench/)

Per round: a fresh random `--cached`-token prefix is prefilled once by a request of one more
token (its full pages are then in the prefix cache); then, per `--new` count n, a request of the
same prefix + n fresh random tokens is submitted to the idle engine and stepped
(`LLMEngine.step()`) until its first token comes back: `hit` is that TTFT (submission to the
step that returned it; the step reads the token back, so the GPU work is done; with overlap
scheduling that is the step after the one that launched it). The request must report
`num_cached_tokens == --cached` (else the run stops: it would time something else). Then the
cache is reset (`reset_prefix_cache`) and the same prompt runs again: `miss`, a full prefill of
the same prompt through the same engine (its pages are registered at the end, a few hundred
microseconds of hashing on the host, the only difference from a cache-off engine). The first
round is a warm-up; medians over the others. The engine is served as it is by default (CUDA
graphs, piecewise prefill graphs, overlap, FP8 KV on CUDA); `piecewise` says whether the hit's
forward replayed piecewise graphs.

Floor (ms) = FLOPs / the bf16 matmul rate measured in this run (bench/prefill.py's
`matmul_rate`, an 8192^3 GEMM) + bytes / the device copy bandwidth measured in this run
(bench/decode.py's `copy_bandwidth`, bytes read + written). With C cached and n new tokens, S =
C + n, L layers, H heads, r = kv_lora_rank, d_r = rope dim, d_n / d_v the nope / value head
dims, keys = n C + n (n + 1) / 2 (each new token sees the cache and the new tokens up to it):
  FLOPs = 2 x active params x n (every parameter but the embedding and the LM head, routed
          experts num_experts_per_tok / n_routed_experts of the way; bench/prefill.py's
          `flop_model`)
        + 2 x LM-head params (one token gets logits)
        + attention, in either form:
            mha: the cached latent is up-projected to per-head K and V,
            2 x C x H x r x (d_n + d_v) per layer (the new tokens' share is in the active
            params), then dense attention, 2 x H x (d_n + d_r + d_v) x keys per layer;
            absorbed: attention over the latent, 2 x H x ((r + d_r) + r) x keys per layer.
          Both are printed (`floor_mha`, `floor_abs`); `floor` is the lower of the two, the
          work's floor whichever form the engine takes. `form` is the one it took (`row_form`):
          backends with `mha_extend` (flashmla on Hopper: kernels_adapter/mha_extend.py) take
          the MHA form but for the hits FlashMLA attends absorbed (`absorbed_hit.py`); the
          other backends and the deterministic mode, the absorbed form.
  bytes = every non-expert weight once (no embedding table: n rows of it)
        + the routed experts the n tokens touch: E = N (1 - (1 - k/N)^n) per MoE layer (the
          expected distinct experts under uniform routing, bench/decode.py's `floor`)
        + the cached KV read once per layer: C x L x (r + d_r) x the pool's bytes per value (FP8:
          1; the pool's FP8 scale is one float per layer, nothing per token).
  Not counted: the MHA form's materialised K / V (S x H x (d_n + d_r + d_v) per layer, written
  and read again: a fused kernel need not), and anything of the MTP layer.

`--profile K`: after the rounds, one more hit per `--new` count runs under torch.profiler and the
table lists its K costliest kernels by device time (CPU ops by host time on the CPU), with the
hit's wall time against the device's busy time (the sum of kernel times: kernels of one stream do
not overlap) and the kernel launch count: wall much above busy says the host (eager launches,
the loop) is the bottleneck, not the kernels.

On the CPU (`--device cpu`, a smoke test) the rate and bandwidth are measured with the host clock
on small float32 operands; the numbers mean little there. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import copy_bandwidth, weight_bytes
from prefill import flop_model, matmul_rate

from mlaserve import LLM, SamplingParams

DEFAULT_MODEL = "/dev/shm/v3lite"  # bench/make_checkpoint.py --arch v3 --mtp --out ...


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_rates(device: torch.device) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s): CUDA through the GPU benchmarks' own measurements; the CPU
    with the host clock on small float32 operands (the smoke test's: meaningless but defined)."""
    if device.type == "cuda":
        return matmul_rate(device), copy_bandwidth(device)
    n, size = 512, 16 << 20
    a, b = torch.randn(n, n), torch.randn(n, n)
    src = torch.randn(size // 4)
    dst = torch.empty_like(src)

    def median_s(fn) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return 2 * n**3 / median_s(lambda: a @ b), 2 * size / median_s(lambda: dst.copy_(src))


def attention_path(llm: LLM) -> str:
    """The form an EXTEND batch's attention takes (model/layers/mla.py's `forward`)."""
    engine = llm.engine
    if engine.config.deterministic_inference:
        return "absorbed"
    return "mha" if engine.runner.attn_backend.mha_extend else "absorbed"


def row_form(llm: LLM, path: str, cached: int, new: int) -> str:
    """The form one hit of `new` tokens over `cached` takes: FlashMLA attends some absorbed."""
    attends_absorbed = getattr(llm.engine.runner.attn_backend, "attends_absorbed", None)
    if path == "mha" and attends_absorbed is not None:
        return "absorbed" if attends_absorbed((new,), (cached + new,)) else "mha"
    return path


def floor_parts(llm: LLM, cached: int, new: int) -> dict[str, float]:
    """FLOPs of both attention forms and the bytes (module docstring)."""
    mc = llm.engine.model_config
    per_token, lm_head, _ = flop_model(llm)
    layers, heads, r = mc.num_hidden_layers, mc.num_attention_heads, mc.kv_lora_rank
    d_n, d_r, d_v = mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim
    keys = new * cached + new * (new + 1) / 2
    linear = 2 * per_token * new + 2 * lm_head
    up_project = 2 * cached * heads * r * (d_n + d_v) * layers
    mha = up_project + 2 * heads * (d_n + d_r + d_v) * keys * layers
    absorbed = 2 * heads * ((r + d_r) + r) * keys * layers
    dense, per_expert, moe_layers = weight_bytes(llm)
    n_exp, k = mc.n_routed_experts or 0, mc.num_experts_per_tok
    touched = n_exp * (1 - (1 - k / n_exp) ** new) if n_exp else 0.0
    pool = llm.engine.runner.kv_pool
    kv = cached * layers * (r + d_r) * pool.kv_buffers[0].element_size()
    return {
        "flops_mha": linear + mha,
        "flops_absorbed": linear + absorbed,
        "bytes": dense + touched * per_expert * moe_layers + kv,
        "kv_bytes": kv,
    }


def first_token_ms(llm: LLM, rid: str, prompt: list[int], device: torch.device) -> tuple:
    """(TTFT ms, the request's num_cached_tokens, piecewise replays it took) of one request on
    an idle engine; it then runs to its end (one token)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    replays = engine.get_stats().num_piecewise_replays
    _sync(device)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft, cached = None, None
    while ttft is None:
        for out in engine.step():
            if out.request_id == rid and out.outputs[0].token_ids:
                ttft, cached = (time.perf_counter() - t0) * 1e3, out.num_cached_tokens
    replays = engine.get_stats().num_piecewise_replays - replays
    while engine.has_unfinished_requests():
        engine.step()
    return ttft, cached, replays


def profile_hit(llm: LLM, prompt: list[int], rid: str, device: torch.device, top: int) -> dict:
    """One hit (its prefix already cached) under torch.profiler: wall ms, device busy ms, the
    kernel launch count and the `top` costliest kernels (CPU: ops by self host time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        ms, cached, _ = first_token_ms(llm, rid, prompt, device)
    key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    if on_cuda:  # the kernels only: a host op's device time is its kernels', counted twice
        events = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_us = sum(getattr(e, key) for e in events)
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    kernels = [
        {"name": e.key[:90], "calls": e.count, "ms": getattr(e, key) / 1e3} for e in events[:top]
    ]
    return {
        "wall_ms": ms, "cached": cached, "busy_ms": busy_us / 1e3,
        "launches": sum(e.count for e in events), "top": kernels,
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    rate, bandwidth = host_rates(device)
    kwargs = {"device": args.device, "enable_prefix_caching": True, "max_num_seqs": 4}
    kwargs["max_model_len"] = args.cached + max(args.new) + 16
    for name in ("kv_cache_dtype", "page_size", "num_pages", "max_num_batched_tokens"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    llm = LLM(args.model or None, **kwargs)
    engine, rng = llm.engine, random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    path = attention_path(llm)
    runs: dict[int, dict[str, list[float]]] = {n: {"hit": [], "miss": []} for n in args.new}
    piecewise: dict[int, bool] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        prefix = [rng.randrange(vocab) for _ in range(args.cached)]
        first_token_ms(llm, f"fill-{r}", [*prefix, rng.randrange(vocab)], device)
        for n in args.new:
            prompt = [*prefix, *(rng.randrange(vocab) for _ in range(n))]
            ms, cached, replays = first_token_ms(llm, f"hit-{r}-{n}", prompt, device)
            if cached != args.cached:
                raise SystemExit(
                    f"the hit request found {cached} cached tokens, not {args.cached}: "
                    "--cached must be a multiple of the page size, and the pool must hold it"
                )
            piecewise[n] = replays > 0
            engine.reset_prefix_cache()
            miss_ms, miss_cached, _ = first_token_ms(llm, f"miss-{r}-{n}", prompt, device)
            if miss_cached != 0:
                raise SystemExit(f"the miss request found {miss_cached} cached tokens, not 0")
            if r:
                runs[n]["hit"].append(ms)
                runs[n]["miss"].append(miss_ms)
    profiles = {}
    if args.profile:
        prefix = [rng.randrange(vocab) for _ in range(args.cached)]
        first_token_ms(llm, "fill-profile", [*prefix, rng.randrange(vocab)], device)
        for n in args.new:
            prompt = [*prefix, *(rng.randrange(vocab) for _ in range(n))]
            profiles[n] = profile_hit(llm, prompt, f"profile-{n}", device, args.profile)
    rows = []
    for n in args.new:
        parts = floor_parts(llm, args.cached, n)
        bytes_ms = parts["bytes"] / bandwidth * 1e3
        floor_mha = parts["flops_mha"] / rate * 1e3 + bytes_ms
        floor_abs = parts["flops_absorbed"] / rate * 1e3 + bytes_ms
        floor = min(floor_mha, floor_abs)
        hit, miss = statistics.median(runs[n]["hit"]), statistics.median(runs[n]["miss"])
        rows.append({
            "cached": args.cached, "new": n, "hit_ms": hit, "miss_ms": miss,
            "miss_over_hit": miss / hit, "floor_ms": floor, "hit_over_floor": hit / floor,
            "floor_mha_ms": floor_mha, "floor_absorbed_ms": floor_abs, "bytes_ms": bytes_ms,
            "form": row_form(llm, path, args.cached, n), "piecewise": piecewise[n], **parts,
        })  # fmt: skip
        if n in profiles:
            rows[-1]["profile"] = profiles[n]
    return {
        "bench": "prefix_prefill",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model or "default-model",
        "kv_cache_dtype": str(engine.runner.kv_pool.dtype).removeprefix("torch."),
        "backend": engine.runner.attn_backend.name,
        "attention_path": path,
        "page_size": engine.config.page_size,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "cuda_graph": engine.config.cuda_graph,
        "matmul_tflops": rate / 1e12,
        "copy_tb_s": bandwidth / 1e12,
        "rounds": args.rounds,
        "rows": rows,
    }


def print_table(report: dict) -> None:
    print(
        f"device: {report['device']}  model: {report['model']}  KV {report['kv_cache_dtype']}  "
        f"backend {report['backend']} (attention form of a prefix prefill: "
        f"{report['attention_path']})  page {report['page_size']}  max_num_batched_tokens "
        f"{report['max_num_batched_tokens']}  matmul {report['matmul_tflops']:.1f} TFLOP/s  "
        f"copy {report['copy_tb_s']:.2f} TB/s"
    )
    print("TTFT of one request (median over rounds): hit = its prefix cached, miss = cache reset")
    print(
        f"{'cached':>7} {'new':>5} {'hit ms':>8} {'miss ms':>8} {'miss/hit':>8} {'floor ms':>9} "
        f"{'hit/floor':>9} {'fl mha':>8} {'fl abs':>8} {'bytes ms':>8} {'form':>8} {'piecewise':>9}"
    )
    for r in report["rows"]:
        print(
            f"{r['cached']:>7} {r['new']:>5} {r['hit_ms']:>8.2f} {r['miss_ms']:>8.2f} "
            f"{r['miss_over_hit']:>8.1f} {r['floor_ms']:>9.2f} {r['hit_over_floor']:>9.2f} "
            f"{r['floor_mha_ms']:>8.2f} {r['floor_absorbed_ms']:>8.2f} {r['bytes_ms']:>8.2f} "
            f"{r['form']:>8} {r['piecewise']!s:>9}"
        )
    for r in report["rows"]:
        if "profile" not in r:
            continue
        p = r["profile"]
        print(
            f"profiled hit, {r['cached']} cached + {r['new']} new: wall {p['wall_ms']:.2f} ms, "
            f"device busy {p['busy_ms']:.2f} ms, {p['launches']} launches"
        )
        for k in p["top"]:
            print(f"  {k['ms']:>8.3f} ms {k['calls']:>5} x  {k['name']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint ('' = the shipped model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cached", type=int, default=8192, help="cached prefix tokens")
    ap.add_argument("--new", type=int, nargs="+", default=[64, 16, 256], help="new tokens")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (after a warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-dtype", default=None, help="default: the engine's")
    ap.add_argument("--page-size", type=int, default=None, help="default: the engine's")
    ap.add_argument("--num-pages", type=int, default=None, help="default: sized from memory")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="also profile one hit per --new count: its K costliest kernels")  # fmt: skip
    args = ap.parse_args()
    if args.cached < 1 or min(args.new) < 1 or args.rounds < 1:
        ap.error("--cached, --new and --rounds must be >= 1")
    report = run(args)
    print_table(report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
