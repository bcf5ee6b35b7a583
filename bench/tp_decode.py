"""Decode step under tensor parallelism on a DeepSeek-V3-width model at reduced depth, FP8 block
weights from `--load-format dummy`, against its floor; and the 61-layer V3 TPOT it implies.

    python3 bench/tp_decode.py --tp 4                      # 1 dense + 7 MoE layers, eager steps
    python3 bench/tp_decode.py --tp 2 --batch-sizes 1 8 --fit-layers 0
    python3 bench/tp_decode.py --tp 4 --graphs             # graphed steps, once TP captures graphs
    python3 bench/tp_decode.py --tp 4 --graphs --arch k2   # Kimi-K2's width (64 heads, 384 experts)
    python3 bench/tp_decode.py --tp 1 --graphs             # the same model on one GPU (TP N's reference)
    python3 bench/tp_decode.py --tp 2 --graphs --profile 20   # + rank 0's 20 costliest kernels per bs
    python3 bench/tp_decode.py --tp 2 --graphs --gaps 8       # + rank 0's GPU idle over --steps steps
    python3 bench/tp_decode.py --tp 2 --graphs --sequence 80  # + rank 0's first 80 ops of a step
    python3 bench/tp_decode.py --tp 2 --graphs --rank-shapes-of 8  # a TP8 rank's step on 2 GPUs

The model: V3's config (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, qk_nope 128, rope 64,
v 128, 256 routed experts top-8 in 8 groups (top 4) + 1 shared, moe_intermediate 2048, dense
intermediate 18432, vocab 129280, FP8 128x128 blocks) with `--layers` layers, the first dense,
written as config.json + the default model's tokenizer files into a temporary folder; weights
random on each rank's GPU (model/dummy_weights.py). Served as `LLM(..., tensor_parallel_size=N,
load_format="dummy")`: rank 0 here, ranks 1..N-1 its worker processes (engine/tp_workers.py).

Measured, in this order, on the same GPUs:
1. the all-reduce of [bs, 7168] bf16 at each batch size, NCCL / one-shot / two-shot / the
   engine's choice, in CUDA graphs (bench/all_reduce.py's `measure`, its own N processes);
2. per depth (`--layers`, then `--fit-layers`), in a fresh process (a fresh process group): the
   device copy bandwidth on cuda:0, then for each batch size `bs` requests whose `--context`
   tokens of KV are taken as computed (bench/decode.py's `fake_prefill`: pages allocated, KV left
   as the pool holds it; a decode step reads the same bytes whatever the values) decode through
   `LLMEngine.step()`; step = wall time per step in the steady state (bench/decode.py's
   `time_steady_steps`: the clock between two returns of `step()`, one step in flight at both),
   median of `--rounds` runs of `--steps` steps; "after sync" = one run of 16 steps from and to
   a synchronised device (`time_steps`, this bench's step before the thirty-sixth session),
   which also holds one refill of the pipeline (rank 0's launch of its first step and the
   workers' lag behind it, ~1 ms at TP2); the all-reduces of one step are counted from a
   torch.profiler trace of a step on rank 0 (kernels named AllReduce / all_reduce: NCCL's and
   symmetric memory's).

Floor per step = rank 0's bytes (bench/decode.py's `floor_ms`: every non-expert weight of this
rank once, the routed experts bs tokens touch in expectation under uniform routing, this rank's
KV read; the embedding table left out) / copy bandwidth + the step's all-reduce count x the best
all-reduce time at that size (the fastest of NCCL, one-shot, two-shot in step 1). The LM head's
all-gather of the logits is not in the floor.

Extrapolation to V3's 61 layers at bs 1, from the two depths L (`--layers`) and F
(`--fit-layers`, default 2: 1 dense + 1 MoE): per layer p = (step_L - step_F) / (L - F); fixed
parts (embedding, LM head, sampling, the step's host work) = step_F - F p; V3 = fixed + 61 p.
V3's 3 dense layers count as MoE layers: at bs 1 a dense MLP (3 x 7168 x 18432) reads the same
bytes as the 8 routed + 1 shared experts a token uses (9 x 3 x 7168 x 2048). The floor is
extrapolated the same way. A time model only: 61 layers at TP N < 8 do not fit in memory. Where
the step grows less per layer than its floor (`fit_holds`: the shorter depth waited on the host),
it prints no TPOT.

Rank shapes of a larger TP (`--rank-shapes-of M`, M a multiple of `--tp`): the dimensions
tensor parallelism splits (heads, the dense and expert intermediate sizes, the vocabulary) scaled
by tp / M, so each of the `--tp` ranks holds the weights, bytes and kernels of a rank of TP M:
TP M's per-rank step measured on fewer GPUs. What differs from TP M is the collectives: their
count per step is TP M's, but each all-reduce spans `--tp` GPUs (issue 42's table: one-shot, bs
1, 6.6 us on 2 H200s, 7.4 on 4), and the floor counts them at `--tp` GPUs' times likewise.

CUDA graphs: the default measures eager steps, so the host's launch time is in them; `--graphs`
measures graphed steps (every rank replays the same graph, its all-reduces inside), as served.

Prints a table, the extrapolation with its method, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

V3_LAYERS = 61
HIDDEN = 7168
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
V3_WIDTH = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": HIDDEN,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}


# Kimi-K2's width (its published config.json): V3's layout with half the heads (64), 384 routed
# experts in one group, a larger vocabulary; 61 layers too, so the extrapolation is the same.
K2_WIDTH = {
    **V3_WIDTH,
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "rope_scaling": {**V3_WIDTH["rope_scaling"], "factor": 32, "beta_fast": 1.0},
}
WIDTHS = {"v3": V3_WIDTH, "k2": K2_WIDTH}
# What tensor parallelism splits (model/layers: mla's heads, mlp's and the experts' intermediate
# sizes, the vocab-parallel embedding and LM head); q_a / kv_a, the router and norms replicate.
SPLIT_DIMS = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
              "moe_intermediate_size", "vocab_size")  # fmt: skip


SYNC_STEPS = 16  # the "after sync" run: the steps of this bench's earlier rounds


def rank_shapes_of(config: dict, tp: int, of: int) -> dict:
    """`config` with every dimension tensor parallelism splits (SPLIT_DIMS) scaled by tp / of:
    served at TP `tp`, each rank then holds the weight shapes and bytes of a rank of TP `of`.
    A proxy for `of` GPUs on `tp`: the same per-rank kernels, but `tp` GPUs' collectives."""
    if of < tp or of % tp:
        raise ValueError(f"rank shapes of TP {of} on TP {tp}: {of} must be a multiple of {tp}")
    out = dict(config)
    for key in SPLIT_DIMS:
        if config[key] % of:
            raise ValueError(f"{key} {config[key]} does not split over {of} ranks")
        out[key] = config[key] // of * tp
    return out


def write_model(
    folder: Path, layers: int, arch: str = "v3", shapes: tuple[int, int] | None = None
) -> Path:
    """config.json (V3's or K2's width, `layers` layers; with `shapes` = (tp, of), a rank of TP
    `of`'s shapes at TP `tp`: `rank_shapes_of`) and the default model's tokenizer files."""
    from mlaserve.config import default_model_path

    folder.mkdir(parents=True, exist_ok=True)
    config = {**WIDTHS[arch], "num_hidden_layers": layers}
    config = rank_shapes_of(config, *shapes) if shapes else config
    (folder / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_path() / name, folder)
    return folder


def step_kernels(llm: Any) -> tuple[list[tuple[str, float, float]], list[tuple]]:
    """(name, GPU us, us it adds to the span) of every kernel one engine step runs on rank 0
    (`decode.kernel_spans`), and its operations in order (`decode.kernel_sequence`): a step
    every rank replays, since a graph with collectives cannot replay on one rank alone."""
    import decode
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.engine.step()
        torch.cuda.synchronize()
    return decode.kernel_spans(prof), decode.kernel_sequence(prof)


def step_gaps(llm: Any, steps: int, top: int) -> dict[str, Any]:
    """Rank 0's GPU over `steps` consecutive engine steps (torch.profiler, CUDA activity): wall
    per step, GPU span / busy / idle per step (idle: the gaps between consecutive operations,
    replay boundaries included), the `top` largest gaps with the operations around them, and
    the median of each step's longest all-reduce kernel (its wait for the slowest rank in)."""
    import time

    import decode
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    for _ in range(2):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
    ops = decode.cuda_ops(prof)
    gaps, last_end, last_name = [], ops[0][1], ops[0][2]  # idle: nothing running (PDL overlaps)
    for start, end, name in ops[1:]:
        gaps.append((start - last_end, last_name, name))
        if end > last_end:
            last_end, last_name = end, name
    gaps.sort(reverse=True)
    ars = [end - start for start, end, name in ops if "allreduce" in name.lower().replace("_", "")]
    per_step = max(1, len(ars) // steps)
    longest = [max(ars[i : i + per_step]) for i in range(0, len(ars) - per_step + 1, per_step)]
    return {
        "wall_ms": wall,
        "gpu_span_ms": (ops[-1][1] - ops[0][0]) / steps / 1e3,
        "gpu_busy_ms": sum(end - start for start, end, _ in ops) / steps / 1e3,
        "gpu_idle_ms": sum(g for g, _, _ in gaps if g > 0) / steps / 1e3,
        "longest_all_reduce_us": statistics.median(longest) if longest else 0.0,
        "largest_gaps": [[round(g, 1), a[:60], b[:60]] for g, a, b in gaps[:top]],
    }


def count_all_reduces(kernels: list[tuple[str, float, float]]) -> int:
    """All-reduce kernels among one step's (NCCL's AllReduce, symmetric memory's one_shot /
    two_shot_all_reduce)."""
    return sum("allreduce" in name.lower().replace("_", "") for name, _, _ in kernels)


def run_depth(args: argparse.Namespace) -> dict[str, Any]:
    """One depth, in this (child) process: the model served with TP N, every batch size."""
    import decode
    import torch

    from mlaserve import LLM
    from mlaserve.config import ConfigError

    bandwidth = decode.copy_bandwidth(torch.device("cuda", 0))
    # every timed step and its warm-ups (steady rounds, the run after a sync), the profile
    new_tokens = args.rounds * (args.steps + 4) + (SYNC_STEPS + 2) + 8
    new_tokens += args.steps + 2 if args.gaps else 0  # the profiled steps of --gaps
    with tempfile.TemporaryDirectory(prefix="tp-decode-v3-") as tmp:
        shapes = (args.tp, args.rank_shapes_of) if args.rank_shapes_of else None
        folder = write_model(Path(tmp), args.layers, args.arch, shapes)
        try:
            llm = LLM(
                str(folder),
                load_format="dummy",
                tensor_parallel_size=args.tp,
                cuda_graph=args.graphs,
                kv_cache_dtype="fp8_e4m3",
                max_num_seqs=max(args.batch_sizes),
                max_model_len=args.context + new_tokens + 16,
                max_num_batched_tokens=max(2048, max(args.batch_sizes)),
                enable_prefix_caching=False,  # fake_prefill's random KV must not be cached
            )
        except ConfigError as exc:
            raise SystemExit(f"the engine refuses this run (--graphs needs CUDA graphs under "
                             f"tensor parallelism, not in this tree yet?): {exc}") from exc  # fmt: skip
        try:
            return _time_batch_sizes(llm, args, bandwidth, new_tokens)
        finally:
            llm.shutdown()


def _time_batch_sizes(llm: Any, args: argparse.Namespace, bandwidth: float,
                      new_tokens: int) -> dict[str, Any]:  # fmt: skip
    import decode

    engine = llm.engine
    rows = []
    for bs in args.batch_sizes:
        decode.fake_prefill(llm, bs, args.context, new_tokens=new_tokens)
        steps = [decode.time_steady_steps(llm, args.steps) for _ in range(args.rounds)]
        after_sync = decode.time_steps(llm, SYNC_STEPS)
        kernels, sequence = step_kernels(llm)
        gaps = step_gaps(llm, args.steps, args.gaps) if args.gaps else None
        decode.finish_all(llm)
        if gaps is not None:
            print(f"rank 0, layers {args.layers}, bs {bs}, {args.steps} steps: wall "
                  f"{gaps['wall_ms']:.3f} ms a step; GPU span {gaps['gpu_span_ms']:.3f}, busy "
                  f"{gaps['gpu_busy_ms']:.3f}, idle {gaps['gpu_idle_ms']:.3f}; a step's longest "
                  f"all-reduce {gaps['longest_all_reduce_us']:.1f} us (median)", flush=True)  # fmt: skip
            for g, before, after in gaps["largest_gaps"]:
                print(f"  {g:8.1f} us  after {before}  before {after}", flush=True)
        if args.profile:
            print(f"rank 0, layers {args.layers}, bs {bs}: one step's kernels", flush=True)
            decode.print_kernel_table(kernels, args.layers, args.profile)
        if args.sequence:
            print(f"rank 0, layers {args.layers}, bs {bs}: one step in order", flush=True)
            decode.print_kernel_sequence(sequence, args.sequence)
        rows.append(
            {
                "bs": bs,
                "step_ms": statistics.median(steps),
                "step_ms_range": [min(steps), max(steps)],
                "step_after_sync_ms": after_sync,
                "all_reduces": count_all_reduces(kernels),
                "bytes_floor_ms": decode.floor_ms(
                    llm, bs, args.context, bandwidth, upper_bound=False
                ),
                **({"gaps": gaps} if gaps is not None else {}),
            }
        )
        print(json.dumps({"layers": args.layers, **rows[-1]}), flush=True)
    dense, per_expert, moe_layers = decode.weight_bytes(llm)
    return {
        "layers": args.layers,
        "graphs": bool(engine.graphs.batch_sizes) and engine.graphs.enabled,
        "backend": engine.runner.attn_backend.name,
        "copy_bandwidth_tbs": bandwidth / 1e12,
        "rank0_nonexpert_bytes": dense,
        "rank0_bytes_per_routed_expert": per_expert,
        "moe_layers": moe_layers,
        "kv_bytes_per_token": engine.runner.kv_pool.bytes_per_token,
        "rows": rows,
    }


def child_run(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """`run_depth` at `layers` in a fresh Python process; its result."""
    with tempfile.TemporaryDirectory(prefix="tp-decode-out-") as tmp:
        out = Path(tmp) / "depth.json"
        cmd = [sys.executable, __file__, "--child", str(out), "--tp", str(args.tp),
               "--layers", str(layers), "--arch", args.arch,
               "--rank-shapes-of", str(args.rank_shapes_of), "--context", str(args.context), "--steps",
               str(args.steps), "--rounds", str(args.rounds), "--batch-sizes",
               *map(str, args.batch_sizes if layers == args.layers else [1]),
               "--profile", str(args.profile if layers == args.layers else 0),
               "--gaps", str(args.gaps if layers == args.layers else 0),
               "--sequence", str(args.sequence if layers == args.layers else 0)]  # fmt: skip
        if args.graphs:
            cmd.append("--graphs")
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def extrapolate(deep: dict, shallow: dict, key: str) -> dict[str, float]:
    """V3's 61 layers at bs 1 from two depths' `key` (ms): per layer, fixed parts, total."""
    big = next(r for r in deep["rows"] if r["bs"] == 1)[key]
    small = next(r for r in shallow["rows"] if r["bs"] == 1)[key]
    per_layer = (big - small) / (deep["layers"] - shallow["layers"])
    fixed = small - shallow["layers"] * per_layer
    return {"per_layer_ms": per_layer, "fixed_ms": fixed, "v3_ms": fixed + V3_LAYERS * per_layer}


def fit_holds(step: dict[str, float], floor: dict[str, float]) -> bool:
    """Whether `extrapolate`'s per-layer step is a layer's cost: a layer cannot take less than
    its floor, so a smaller slope means the shorter depth's step was bound by something that
    does not grow with depth (rank 0's host at bs 1 once a rank's layers are small)."""
    return step["per_layer_ms"] >= floor["per_layer_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, required=True, help="tensor-parallel size (GPUs)")
    ap.add_argument("--layers", type=int, default=8, help="layers, the first dense (default 8)")
    ap.add_argument("--fit-layers", type=int, default=2,
                    help="second depth for the 61-layer extrapolation (0: none)")  # fmt: skip
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--arch", choices=sorted(WIDTHS), default="v3",
                    help="the width: DeepSeek-V3's (default) or Kimi-K2's")  # fmt: skip
    ap.add_argument("--context", type=int, default=1024, help="tokens of KV per sequence")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--graphs", action="store_true", help="graphed steps (needs graphs under TP)")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="print rank 0's K costliest kernels of one step per batch size")  # fmt: skip
    ap.add_argument("--sequence", type=int, default=0, metavar="K",
                    help="print rank 0's first K operations of one step in order (start, "
                         "duration, gap): a kernel's time in the step, which a chain of it alone "
                         "can misstate")  # fmt: skip
    ap.add_argument("--gaps", type=int, default=0, metavar="K",
                    help="profile --steps steps on rank 0 per batch size: GPU idle, the K "
                         "largest gaps")  # fmt: skip
    ap.add_argument("--rank-shapes-of", type=int, default=0, metavar="M",
                    help="give each of the --tp ranks the weight shapes of a rank of TP M (heads, "
                         "intermediate sizes, vocabulary scaled by tp / M): TP M's per-rank step "
                         "on --tp GPUs, with --tp GPUs' all-reduces (0: off)")  # fmt: skip
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: one depth's run
    args = ap.parse_args()
    if args.child:
        args.child.write_text(json.dumps(run_depth(args)))
        return
    if args.fit_layers and not 1 <= args.fit_layers < args.layers:
        raise SystemExit(f"--fit-layers {args.fit_layers}: must be in [1, --layers)")
    if args.rank_shapes_of:
        try:
            rank_shapes_of(WIDTHS[args.arch], args.tp, args.rank_shapes_of)
        except ValueError as exc:
            raise SystemExit(f"--rank-shapes-of: {exc}") from exc
    import all_reduce
    import torch

    sizes = sorted({1, *args.batch_sizes})  # 1: the fit
    if args.tp > 1:
        ar = all_reduce.measure(args.tp, [HIDDEN], sizes)
    else:  # TP1, the reference for TP N: no collective in its step or its floor
        ar = {"rows": [{"bs": bs, "best_us": 0.0, "chosen": "-"} for bs in sizes], "plan": None}
    ar_by_bs = {r["bs"]: r for r in ar["rows"]}
    deep = child_run(args, args.layers)
    shallow = child_run(args, args.fit_layers) if args.fit_layers else None
    for depth in filter(None, (deep, shallow)):
        for r in depth["rows"]:
            best = ar_by_bs[r["bs"]]["best_us"]
            r["all_reduce_best_us"] = best
            r["all_reduce_chosen"] = ar_by_bs[r["bs"]]["chosen"]
            r["floor_ms"] = r["bytes_floor_ms"] + r["all_reduces"] * best / 1e3
            r["step_vs_floor"] = r["step_ms"] / r["floor_ms"]
    mode = "graphed" if deep["graphs"] else "eager (CUDA graphs under TP not in this tree)"
    of = args.rank_shapes_of or args.tp
    shapes = f", each rank a TP {of} rank's shapes" if args.rank_shapes_of else ""
    import mlaserve

    print(f"package: {Path(mlaserve.__file__).parent}")  # which tree an A/B ran
    print(f"\ndevice: {args.tp} x {torch.cuda.get_device_name()}  {args.arch.upper()} width{shapes}, "
          f"{args.layers} layers "
          f"(1 dense), FP8 block weights (dummy), KV fp8, ctx {args.context}, steps {mode}, "
          f"backend {deep['backend']}, copy BW {deep['copy_bandwidth_tbs']:.2f} TB/s")  # fmt: skip
    print(f"{'bs':>4} {'step ms':>8} {'after sync':>10} {'bytes ms':>8} {'ARs':>4} {'AR us':>6} "
          f"{'AR path':>8} {'floor ms':>8} {'step/floor':>10}")  # fmt: skip
    for r in deep["rows"]:
        print(f"{r['bs']:>4} {r['step_ms']:>8.3f} {r['step_after_sync_ms']:>10.3f} "
              f"{r['bytes_floor_ms']:>8.3f} "
              f"{r['all_reduces']:>4} {r['all_reduce_best_us']:>6.1f} "
              f"{r['all_reduce_chosen']:>8} {r['floor_ms']:>8.3f} {r['step_vs_floor']:>10.2f}")  # fmt: skip
    summary: dict[str, Any] = {
        "bench": "tp_decode",
        "device": torch.cuda.get_device_name(),
        "tp": args.tp,
        "rank_shapes_of": of,
        "package": str(Path(mlaserve.__file__).parent),
        "arch": args.arch,
        "steps": "graphed" if deep["graphs"] else "eager",
        "context": args.context,
        "all_reduce": ar,
        "depths": [d for d in (deep, shallow) if d],
    }
    if shallow and 1 in args.batch_sizes:
        step, floor = extrapolate(deep, shallow, "step_ms"), extrapolate(deep, shallow, "floor_ms")
        summary["v3_61_layers_bs1"] = {"step": step, "floor": floor}
        proxy = f" (its rank shapes on {args.tp} GPUs)" if args.rank_shapes_of else ""
        print(f"\n{args.arch.upper()}, 61 layers, TP {of}{proxy}, bs 1 (a time model: per layer from {args.layers} - "
              f"{args.fit_layers} layers, fixed = step_{args.fit_layers} - {args.fit_layers} x "
              f"per layer, V3 = fixed + 61 x per layer; dense layers counted as MoE ones):")  # fmt: skip
        if not fit_holds(step, floor):
            summary["v3_61_layers_bs1"]["fit_holds"] = False
            print(f"  not extrapolated: the step grows {step['per_layer_ms']:.3f} ms a layer, less "
                  f"than its floor's {floor['per_layer_ms']:.3f} (the shorter depth's step waits "
                  f"on the host, not the GPU); time a layer in --sequence instead")  # fmt: skip
        else:
            print(f"  TPOT {step['v3_ms']:.2f} ms ({step['per_layer_ms']:.3f} ms/layer, fixed "
                  f"{step['fixed_ms']:.2f} ms); floor {floor['v3_ms']:.2f} ms "
                  f"({floor['per_layer_ms']:.3f} ms/layer); TensorRT-LLM, 8 x H200 with MTP: 6.3 ms")  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
