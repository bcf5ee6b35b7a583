"""Decode step time, graphed vs eager, against the bytes floor, through the real engine loop.

    python3 bench/decode.py                          # the shipped default model
    python3 bench/decode.py --model /tmp/v2lite      # bench/make_checkpoint.py's V2-Lite shape
    python3 bench/decode.py --model /tmp/v2lite /tmp/v2lite-fp8   # bf16 vs its FP8 twin, one run

For each (context, batch size): `bs` requests whose prompts' KV is already in the cache (the
pages are allocated by the scheduler and hold random values: a prefill's cost is bench/
prefill.py's business, and a decode step reads the same bytes either way) decode `--steps`
tokens through `LLMEngine.step()` with CUDA graphs, then again eagerly (the same engine with its
graph runner switched off), interleaved, `--rounds` times; medians are reported.

Columns:
- eager / graph: wall time per engine step (host batch build + forward + sampling + postprocess);
  with overlap scheduling (on with CUDA) the host's part of a step runs while the GPU computes
  the next one, so a graphed step costs about max(host, replay);
- sync: graphed steps with overlap scheduling off (each step's tokens read back before the next
  step is built), interleaved with the others: what the overlap saves;
- replay: the graph replay alone (CUDA events), i.e. the GPU time of a graphed forward;
- kern/layer: GPU kernels in one replay of the decode graph (torch.profiler), over the layer
  count (the LM head, embedding and sampling-free glue are spread over the layers);
- floor: bytes a decode step must read / device copy bandwidth measured in this run. Bytes =
  every non-expert weight once + the routed experts the step's tokens touch + the KV read.
  Routed experts: `floor` counts the expected number of distinct experts under uniform random
  routing, E = n (1 - (1 - k/n)^bs); `floor_ub` counts min(n, k*bs), the upper bound the issue's
  baseline figures use;
- attention: all layers' attention in a CUDA graph, through the adapter vs the same necessary
  work written by hand (schedule + q preparation + kernel) vs the kernel alone (see
  `attention_overhead`).

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from mlaserve import LLM
from mlaserve.config import ModelConfig
from mlaserve.kernels_adapter.flashmla import flashmla_available


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def weight_bytes(llm: LLM) -> tuple[int, int, int]:
    """(bytes of everything but routed experts, bytes of one routed expert, MoE layer count).
    The embedding table is excluded: a step reads only bs rows of it."""
    model, mc = llm.engine.runner.model, llm.engine.model_config
    dense, experts = 0, 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or "embed_tokens" in name:
            continue
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:  # routed experts (shared ones are `shared_experts`)
            experts += nbytes
        else:
            dense += nbytes
    moe_layers = sum(mc.is_moe_layer(i) for i in range(mc.num_hidden_layers))
    per_expert = experts // max(moe_layers * (mc.n_routed_experts or 1), 1) if moe_layers else 0
    return dense, per_expert, moe_layers


def floor_ms(llm: LLM, bs: int, ctx: int, bandwidth: float, upper_bound: bool) -> float:
    mc = llm.engine.model_config
    dense, per_expert, moe_layers = weight_bytes(llm)
    n, k = mc.n_routed_experts or 0, mc.num_experts_per_tok
    touched = min(n, k * bs) if upper_bound else (n * (1 - (1 - k / n) ** bs) if n else 0)
    kv = bs * ctx * llm.engine.runner.kv_pool.bytes_per_token
    return (dense + touched * per_expert * moe_layers + kv) / bandwidth * 1e3


def fake_prefill(llm: LLM, bs: int, ctx: int, new_tokens: int) -> None:
    """Admit `bs` requests whose first `ctx` tokens' KV is taken as computed (random values)."""
    from mlaserve import SamplingParams

    engine = llm.engine
    if engine.config.enable_prefix_caching:
        # its pages hold random KV and skip admission: registered, they would be wrong hits
        raise SystemExit("fake_prefill: build the LLM with enable_prefix_caching=False")
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True)
    for i in range(bs):
        prompt = [(7 * i + 13 * j) % vocab for j in range(ctx)]
        engine.add_request(f"bench-{bs}-{ctx}-{i}", prompt, params)
    sched = engine.scheduler
    while sched.waiting:
        r = sched.waiting.popleft()
        r.output_token_ids.append(r.prompt_token_ids[-1])
        assert sched._reserve(r, ctx + 1), "KV cache too small for the benchmark"
        r.num_computed_tokens = ctx
        r.status = type(r.status).RUNNING
        r.slot = sched._free_slots.pop()
        engine.runner.sampling_slots.admit(r.slot, r.params, r.seed, r.prompt_token_ids)
        sched.running.append(r)


def finish_all(llm: LLM) -> None:
    engine = llm.engine
    for rid in list(engine.requests):
        engine.abort_request(rid)


def time_steps(llm: LLM, steps: int) -> float:
    engine = llm.engine
    for _ in range(2):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def time_steady_steps(llm: LLM, steps: int, warm: int = 4) -> float:
    """ms per engine step in the steady state: `warm` steps first, then the clock runs from the
    return of one step to the return of the `steps`-th after it, both at the same point of the
    overlapped pipeline (one step in flight), so no drain or refill is in the figure.
    `time_steps` instead starts and ends on a synchronised device: its figure holds one refill
    (the host's launch of the first step, under TP also the workers' lag behind it)."""
    engine = llm.engine
    for _ in range(warm):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / steps * 1e3


def decode_graph(llm: LLM, bs: int) -> torch.cuda.CUDAGraph:
    graphs = llm.engine.graphs
    size = min(s for s in graphs.batch_sizes if s >= bs)
    return next(g for (m, q, b), g in graphs.graphs.items() if b == size and q == 1).graph


def time_replay(llm: LLM, bs: int) -> float:
    return replay_ms(decode_graph(llm, bs), 20)


def replay_kernels(graph: torch.cuda.CUDAGraph) -> list[tuple[str, float, float]]:
    """(name, GPU us, us it adds to the replay's span) of every kernel one replay of the decode
    graph runs, in start order (torch.profiler / CUPTI records each kernel node of a replayed
    graph; memcpy and memset nodes are left out). Under PDL a kernel's duration includes its
    wait for the previous one, so durations overlap; what a kernel adds to the span, its end
    past every earlier kernel's end, is its share of the critical path (the adds sum to the
    span from the first kernel's end to the last one's)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return kernel_spans(prof)


def kernel_spans(prof) -> list[tuple[str, float, float]]:
    """(name, GPU us, us it adds to the span) of a torch.profiler trace's kernels, in start
    order, memcpy and memset left out (`replay_kernels` says what "adds" means)."""
    from torch.autograd import DeviceType

    events = sorted(
        (e.time_range.start, e.time_range.end, e.name, e.device_time)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.name.lower().startswith(("memcpy", "memset"))
    )
    out, last_end = [], None
    for _start, end, name, us in events:
        adds = 0.0 if last_end is None else max(0.0, end - last_end)
        last_end = end if last_end is None else max(last_end, end)
        out.append((name, us, adds))
    return out


def cuda_ops(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every CUDA operation of a torch.profiler trace (kernels and
    copies), in start order."""
    from torch.autograd import DeviceType

    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )


def kernel_sequence(prof) -> list[tuple[float, float, float, str]]:
    """(start us after the first, GPU us, gap us, name) of every `cuda_ops` operation in start
    order: the gap is the start minus the latest end before it (negative where a PDL launch
    overlaps its predecessor)."""
    ops = cuda_ops(prof)
    out, first, last_end = [], ops[0][0] if ops else 0.0, None
    for start, end, name in ops:
        gap = 0.0 if last_end is None else start - last_end
        last_end = end if last_end is None else max(last_end, end)
        out.append((start - first, end - start, gap, name))
    return out


def print_kernel_sequence(sequence: list[tuple[float, float, float, str]], count: int) -> None:
    """The first `count` operations of `kernel_sequence`, one a line."""
    print(f"  {'#':>4} {'start us':>9} {'us':>8} {'gap us':>7}  name")
    for i, (start, us, gap, name) in enumerate(sequence[:count]):
        print(f"  {i:4d} {start:9.1f} {us:8.2f} {gap:7.2f}  {name[:90]}")


def print_kernel_table(kernels: list[tuple[str, float, float]], layers: int, top: int = 25) -> None:
    """Kernels grouped by name, by the span they add (the critical path): one replay's profile."""
    by_name: dict[str, list[tuple[float, float]]] = {}
    for name, us, adds in kernels:
        by_name.setdefault(name, []).append((us, adds))
    total = sum(us for _, us, _ in kernels)
    span = sum(adds for _, _, adds in kernels)
    print(
        f"  top kernels of one replay ({len(kernels)} kernels, {total / 1e3:.3f} ms busy, "
        f"{span / 1e3:.3f} ms span after the first)"
    )
    print(
        f"  {'adds us':>9} {'share':>6} {'busy us':>9} {'count':>5} {'/layer':>6} "
        f"{'adds each':>9}  name"
    )
    ranked = sorted(by_name.items(), key=lambda kv: -sum(a for _, a in kv[1]))
    for name, times in ranked[:top]:
        added = sum(a for _, a in times)
        busy = sum(u for u, _ in times)
        print(
            f"  {added:>9.1f} {added / max(span, 1e-9):>6.1%} {busy:>9.1f} {len(times):>5} "
            f"{len(times) / layers:>6.2f} {added / len(times):>9.2f}  {name[:90]}"
        )


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int) -> float:
    """Mean time of one replay over `iters` back-to-back replays (CUDA events), after one."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def attention_overhead(llm: LLM, bs: int, ctx: int) -> dict:
    """All layers' attention, each variant captured in a CUDA graph and replayed:

    - adapter: `FlashMLABackend.prepare` + `forward` as the model calls them (the layer has
      already written the new KV in its fused latent-norm + rope + KV-write kernel, which
      replaces the norm and rope it needs anyway, so `kv_c = k_pe = None`);
    - direct: the same necessary work written by hand: the split schedule, the q preparation
      kernel (concat + cast to the kernel's layout) and `flash_mla_with_kvcache`;
    - kernel: `flash_mla_with_kvcache` alone on inputs prepared in advance.

    overhead = adapter / direct - 1 (what the abstraction adds); glue = direct / kernel - 1."""
    engine = llm.engine
    runner, backend, mc = engine.runner, engine.runner.attn_backend, engine.model_config
    if backend.name != "flashmla":
        return {}
    import flash_mla

    from mlaserve.ops.q_prep import prepare_q

    engine.drain()  # the last step's tokens on the host (overlap scheduling)
    host = runner.build_host_batch(engine.scheduler.schedule())
    batch = runner.make_batch(host, max_seq_len=runner.max_model_len)
    h, r, dr = mc.num_attention_heads, mc.kv_lora_rank, mc.qk_rope_head_dim
    layers, dt, pool = mc.num_hidden_layers, torch.bfloat16, runner.kv_pool
    q_nope = torch.randn(bs, h, r, device="cuda", dtype=dt) * 0.1
    q_pe = torch.randn(bs, h, dr, device="cuda", dtype=dt) * 0.1
    q_dtype = torch.float8_e4m3fn if pool.is_fp8 else dt
    q_ready = prepare_q(q_nope, q_pe, q_dtype).view(bs, 1, h, r + dr)
    extra = {}
    if pool.is_fp8:
        extra = {"descale_q": backend._q_descale, "descale_k": pool.k_scale_tensors[0]}

    def schedule():
        sched, _ = flash_mla.get_mla_metadata()
        sched.tile_scheduler_metadata, sched.num_splits = flash_mla.get_mla_decoding_metadata(
            batch.seq_lens, h, 1, is_fp8_kvcache=pool.is_fp8, use_legacy=True
        )
        return sched

    def kernel(q, sched, layer):
        flash_mla.flash_mla_with_kvcache(
            q, pool.kv_buffers[layer].unsqueeze(2), batch.block_tables, batch.seq_lens,
            head_dim_v=r, tile_scheduler_metadata=sched, softmax_scale=backend.softmax_scale,
            causal=True, is_fp8_kvcache=pool.is_fp8, use_legacy=True, **extra,
        )  # fmt: skip

    def adapter():
        backend.prepare(batch)
        for layer in range(layers):
            backend.forward(layer, q_nope, q_pe, None, None, batch)

    def direct():
        sched = schedule()
        for layer in range(layers):
            kernel(prepare_q(q_nope, q_pe, q_dtype).view(bs, 1, h, r + dr), sched, layer)

    sched0 = schedule()

    def kernel_only():
        for layer in range(layers):
            kernel(q_ready, sched0, layer)

    result = {}
    for name, fn in (("adapter", adapter), ("direct", direct), ("kernel", kernel_only)):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        result[name + "_ms"] = replay_ms(graph, 50)
    result["overhead"] = result["adapter_ms"] / result["direct_ms"] - 1
    result["glue"] = result["direct_ms"] / result["kernel_ms"] - 1
    return result


def bench_model(model: str | None, args: argparse.Namespace, bandwidth: float) -> dict:
    """Every (context, batch size) cell for one checkpoint; prints its table; returns its report."""
    mc = ModelConfig.from_pretrained(model) if model else None
    limit = mc.max_position_embeddings if mc else None
    new_tokens = (args.steps + 2) * (args.rounds * 3 + 1) + 8  # 3 timings a round, + replays
    max_len = max(args.contexts) + new_tokens + 16
    if limit is not None and max_len > limit:
        raise SystemExit(f"--contexts: {max_len} tokens exceed the model's limit {limit}")
    t0 = time.perf_counter()
    llm = LLM(
        model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=max_len,
        max_num_batched_tokens=max(2048, max(args.batch_sizes)),
        enable_prefix_caching=False,  # fake_prefill's random KV must not become cached pages
    )
    load_s = time.perf_counter() - t0
    engine = llm.engine
    overlap = engine.overlap
    pool = engine.runner.kv_pool
    for buf in pool.kv_buffers:  # random KV: never time on zeros
        buf.view(torch.uint8).copy_(torch.randint_like(buf.view(torch.uint8), 0, 120))
    rows = []
    bench_compiles = 0
    for ctx in args.contexts:
        for bs in args.batch_sizes:
            fake_prefill(llm, bs, ctx, new_tokens=new_tokens)
            eager, graph, sync = [], [], []
            for _ in range(args.rounds):
                engine.graphs.enabled = False
                eager.append(time_steps(llm, args.steps))
                engine.graphs.enabled = True
                graph.append(time_steps(llm, args.steps))
                if overlap:  # the same graphed steps, each read back before the next
                    engine.drain()
                    engine.overlap = False
                    sync.append(time_steps(llm, args.steps))
                    engine.overlap = True
            replay = time_replay(llm, bs)
            profile = replay_kernels(decode_graph(llm, bs))
            kernels = len(profile)
            if args.kernel_table:
                print(f"model {model or 'default-model'} ctx {ctx} bs {bs}:")
                print_kernel_table(profile, engine.model_config.num_hidden_layers)
            # The attention comparison launches kernels the engine does not (e.g. FlashMLA's q
            # preparation where the model takes the joined query): their compiles are the
            # bench's, not the serving engine's, and are left out of the count below.
            before = engine.compile_watch.compiles_since_ready
            attn = attention_overhead(llm, bs, ctx) if ctx == args.contexts[0] else {}
            bench_compiles += engine.compile_watch.compiles_since_ready - before
            finish_all(llm)
            row = {
                "ctx": ctx,
                "bs": bs,
                "eager_ms": statistics.median(eager),
                "graph_ms": statistics.median(graph),
                "graph_ms_range": [min(graph), max(graph)],
                "overlap": overlap,
                # graphed steps without overlap scheduling (= graph_ms when it is off)
                "sync_ms": statistics.median(sync) if sync else statistics.median(graph),
                "replay_ms": replay,
                "kernels_per_step": kernels,
                "kernels_per_layer": kernels / engine.model_config.num_hidden_layers,
                "floor_ms": floor_ms(llm, bs, ctx, bandwidth, upper_bound=False),
                "floor_ub_ms": floor_ms(llm, bs, ctx, bandwidth, upper_bound=True),
                **{f"attn_{k}": v for k, v in attn.items()},
            }
            row["speedup"] = row["eager_ms"] / row["graph_ms"]
            row["graph_vs_floor"] = row["graph_ms"] / row["floor_ms"]
            row["graph_vs_floor_ub"] = row["graph_ms"] / row["floor_ub_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    serving_compiles = engine.get_stats().num_compiles_while_serving - bench_compiles
    name = model or "default-model"
    report = engine.graph_report
    weights = engine.model_config.quantization
    print(
        f"\ndevice: {torch.cuda.get_device_name()}  model: {name}  "
        f"weights {'fp8 block' if weights else 'unquantized'}  KV {args.kv_cache_dtype}  "
        f"backend {engine.runner.attn_backend.name}  copy BW {bandwidth / 1e12:.2f} TB/s  "
        f"load {load_s:.1f} s  graphs {report.num_graphs} ({report.pool_bytes / 2**20:.0f} MiB, "
        f"capture {report.capture_s:.2f} s)  compiles while serving {serving_compiles}"
    )
    print(
        f"{'ctx':>5} {'bs':>3} {'eager ms':>9} {'graph ms':>9} {'sync ms':>8} {'speedup':>7} "
        f"{'replay ms':>9} "
        f"{'floor ms':>8} {'g/floor':>7} {'floor_ub':>8} {'g/f_ub':>6} {'kern/layer':>10} "
        f"{'attn adapter/direct/kernel ms (overhead, glue)':>46}"
    )
    for r in rows:
        attn = (
            f"{r['attn_adapter_ms']:.3f}/{r['attn_direct_ms']:.3f}/{r['attn_kernel_ms']:.3f} "
            f"({r['attn_overhead']:+.1%}, {r['attn_glue']:+.1%})"
            if "attn_adapter_ms" in r
            else ""
        )
        print(
            f"{r['ctx']:>5} {r['bs']:>3} {r['eager_ms']:>9.2f} {r['graph_ms']:>9.3f} "
            f"{r['sync_ms']:>8.3f} {r['speedup']:>7.2f} {r['replay_ms']:>9.3f} "
            f"{r['floor_ms']:>8.3f} {r['graph_vs_floor']:>7.2f} {r['floor_ub_ms']:>8.3f} {r['graph_vs_floor_ub']:>6.2f} "
            f"{r['kernels_per_layer']:>10.1f} {attn:>46}"
        )
    result = {
        "model": name,
        "fp8_weights": weights is not None,
        "kv_cache_dtype": args.kv_cache_dtype,
        "backend": engine.runner.attn_backend.name,
        "graph_pool_mib": report.pool_bytes / 2**20,
        "capture_s": report.capture_s,
        "compiles_while_serving": serving_compiles,
        "rows": rows,
    }
    del llm, engine, pool
    gc.collect()
    torch.cuda.empty_cache()
    return result


def compare(first: dict, second: dict) -> list[dict]:
    """Per cell: second's graphed step over first's, and each one's bytes floor."""
    out = []
    for a, b in zip(first["rows"], second["rows"], strict=True):
        out.append(
            {
                "ctx": a["ctx"],
                "bs": a["bs"],
                "first_graph_ms": a["graph_ms"],
                "second_graph_ms": b["graph_ms"],
                "ratio": b["graph_ms"] / a["graph_ms"],
                "first_floor_ms": a["floor_ms"],
                "second_floor_ms": b["floor_ms"],
                "second_vs_own_floor": b["graph_ms"] / b["floor_ms"],
            }
        )
    print(f"\n{second['model']} vs {first['model']} (graphed step, same run)")
    print(
        f"{'ctx':>5} {'bs':>3} {'first ms':>9} {'second ms':>9} {'ratio':>6} "
        f"{'floor 1st':>9} {'floor 2nd':>9} {'2nd/floor':>9}"
    )
    for r in out:
        print(
            f"{r['ctx']:>5} {r['bs']:>3} {r['first_graph_ms']:>9.3f} {r['second_graph_ms']:>9.3f} "
            f"{r['ratio']:>6.2f} {r['first_floor_ms']:>9.3f} {r['second_floor_ms']:>9.3f} "
            f"{r['second_vs_own_floor']:>9.2f}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        nargs="+",
        default=[None],
        help="checkpoint folder(s) (default: shipped model); with two, also their step ratio "
        "(e.g. a bf16 checkpoint and its FP8 block-quantized twin from tools/fp8_checkpoint.py)",
    )
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--kernel-table", action="store_true", help="print each cell's top kernels by GPU time"
    )
    args = ap.parse_args()
    if len(args.model) > 2:
        raise SystemExit("--model: at most two checkpoints (the second is compared to the first)")
    bandwidth = copy_bandwidth(torch.device("cuda"))
    results = [bench_model(m, args, bandwidth) for m in args.model]
    summary = {
        "bench": "decode",
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_tbs": bandwidth / 1e12,
        "models": results,
    }
    if len(results) == 2:
        summary["comparison"] = compare(*results)
    print(json.dumps(summary))


if __name__ == "__main__":
    if not flashmla_available():
        print("note: FlashMLA unavailable; attention overhead column skipped")
    main()
