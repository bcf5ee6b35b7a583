"""Decode-sized linears: the GEMV (`mlaserve/ops/gemv.py`) vs cuBLAS and block_fp8_linear.

Each against the bytes floor: bf16 weights vs F.linear (cuBLAS), FP8 ones vs block_fp8_linear.

    python3 bench/gemv.py [--m 1 2 4 8] [--shapes v2lite.q_proj v3.o_proj] [--weights bf16 fp8]
    python3 bench/gemv.py --sweep-configs --shapes v2lite.kv_a    # tiles, one shape at a time

Shapes: DeepSeek-V2-Lite's q_proj, kv_a, the merged q|kv_a, o_proj and router (hidden 2048) and
DeepSeek-V3's q_a, q_b, kv_a and o_proj; random weights, bf16 and FP8 (128 x 128 block scales;
the merged q|kv_a keeps block scales, its 3072 | 576 seam is on a block boundary; the router
is bf16 only). Per (shape, weights, M), GPU time per call inside a CUDA graph (`fusions.py`'s
timer: median of 5 replays, launch overhead excluded, as in the decode graph) of:

    gemv     this kernel, default tiles (`gemv_config`)
    base     bf16: F.linear (cuBLAS); FP8: block_fp8_linear with its default dispatch
             (`gemm_backend`: the W8A16 Triton kernel up to W8A16_MAX_M tokens, one included)

Each graph calls the op on distinct weight copies in turn (>= 256 MB of them, ~5x an H100's
L2), so every call streams its weight from HBM as in a real step. floor = weight + scale bytes
/ the device copy bandwidth measured in this run (`decode.py`).

`--sweep-configs` also times tile choices (block_n x num_warps x weight vectors per thread per
step, which set block_k; there is no K split to sweep: a deterministic one needs a second
launch) and prints the best per (shape, weights, M) as it goes. Each tile is a Triton compile
(~0.5 s), ~30 per (shape, weights, M): sweep a few shapes per run to stay within time limits.

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth
from fusions import graph_time_us
from moe_decode import in_turn

from mlaserve.ops.fp8_gemm import block_fp8_linear, gemm_backend
from mlaserve.ops.fp8_quant import expand_scale_rows, quantize_weight_block
from mlaserve.ops.gemv import GemvConfig, gemv, gemv_config, gemv_reference

# name: (N, K)
SHAPES = {
    "v2lite.q_proj": (3072, 2048),
    "v2lite.kv_a": (576, 2048),
    "v2lite.q_kv_a": (3648, 2048),
    "v2lite.o_proj": (2048, 2048),
    "v2lite.router": (64, 2048),
    "v3.q_a": (1536, 7168),
    "v3.q_b": (24576, 1536),
    "v3.kv_a": (576, 7168),
    "v3.o_proj": (7168, 16384),
    # one rank's share under tensor parallelism (q_a | kv_a replicated, merged)
    "v3.q_kv_a": (2112, 7168),
    "v3tp2.q_b": (12288, 1536),
    "v3tp2.o_proj": (7168, 8192),
    "v3tp2.dense_gate_up": (18432, 7168),  # the dense MLP's merged gate | up, one rank's rows
    "v3tp2.dense_down": (7168, 9216),
    "v3tp4.q_b": (6144, 1536),
    "v3tp4.o_proj": (7168, 4096),
}
PER_ROW_SCALES: set[str] = set()  # every shape here has 128-aligned seams
BF16_ONLY = {"v2lite.router"}
L2_FLUSH_BYTES = 256 << 20
REPS = 5


def sweep_configs(k: int) -> list[GemvConfig]:
    """block_n 1..32 x 4 or 8 warps x 1, 2, 4, 8 or 16 vectors of 8 weight elements per thread per
    step (block_k follows, clamped as `gemv_config` does)."""
    configs = []
    for block_n in (1, 2, 4, 8, 16, 32):
        for warps in (4, 8):
            for vectors in (1, 2, 4, 8, 16):
                block_k = vectors * 8 * 32 * warps // block_n
                block_k = max(16, min(block_k, triton.next_power_of_2(k)))
                if GemvConfig(block_n, block_k, warps) not in configs:
                    configs.append(GemvConfig(block_n, block_k, warps))
    return configs


def make_weights(n: int, k: int, fp8: bool, per_row: bool) -> list[tuple]:
    """Enough distinct (w, scale) copies that they overflow L2 several times."""
    nbytes = n * k * (1 if fp8 else 2)
    weights = []
    for _ in range(max(2, -(-L2_FLUSH_BYTES // nbytes))):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        if not fp8:
            weights.append((w, None))
            continue
        w_q, scale = quantize_weight_block(w)
        weights.append((w_q, expand_scale_rows(scale, n) if per_row else scale))
    return weights


def time_us(fn, copies: int, iters: int) -> float:
    """GPU us per fn(i) call, the copies taken in turn; at least one call per copy per graph."""
    return graph_time_us(in_turn(fn, copies), max(iters, copies), REPS)


def bench_shape(name: str, args: argparse.Namespace, bandwidth: float, rows, sweep) -> None:
    for kind in args.weights:
        if kind == "bf16" or name not in BF16_ONLY:
            bench_weights(name, kind == "fp8", args, bandwidth, rows, sweep)
            torch.cuda.empty_cache()


def bench_weights(name: str, fp8: bool, args, bandwidth: float, rows, sweep) -> None:
    """Every M for one shape and weight format; appends to `rows` (and `sweep`)."""
    n, k = SHAPES[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = make_weights(n, k, fp8, name in PER_ROW_SCALES)
    copies = len(weights)
    nbytes = sum(t.numel() * t.element_size() for t in weights[0] if t is not None)
    for m in args.m:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w0, s0 = weights[0]
        ref = gemv_reference(x, w0, s0)
        err = float((gemv(x, w0, s0).float() - ref).abs().max() / ref.abs().max())
        if fp8:
            base = "fp8_" + gemm_backend(x.device, m, n, k, s0.shape[0], x.dtype)

            def base_fn(i, x=x):
                return block_fp8_linear(x, *weights[i])
        else:
            base = "cublas"

            def base_fn(i, x=x):
                return F.linear(x, weights[i][0])

        row = {
            "shape": name, "weights": "fp8" if fp8 else "bf16", "m": m, "n": n, "k": k,
            "base": base, "config": list(gemv_config(m, n, k, fp8, sms)),
            "gemv_us": time_us(lambda i, x=x: gemv(x, *weights[i]), copies, args.iters),
            "base_us": time_us(base_fn, copies, args.iters),
            "floor_us": nbytes / bandwidth * 1e6,
            "max_rel_err": err,
        }  # fmt: skip
        row["gemv_vs_floor"] = row["gemv_us"] / row["floor_us"]
        row["base_vs_floor"] = row["base_us"] / row["floor_us"]
        row["speedup"] = row["base_us"] / row["gemv_us"]
        rows.append(row)
        if args.sweep_configs:
            sweep_one(row, x, weights, args, sweep)


def sweep_one(row: dict, x: torch.Tensor, weights: list, args, sweep: list) -> None:
    times = []
    for cfg in sweep_configs(row["k"]):

        def fn(i, cfg=cfg):
            return gemv(x, *weights[i], config=cfg)

        try:
            times.append((time_us(fn, len(weights), args.iters), cfg))
        except Exception as e:  # a tile that does not compile (registers, shared memory)
            print(f"  {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
    times.sort()
    best_us, best = times[0]
    entry = {
        "shape": row["shape"], "weights": row["weights"], "m": row["m"],
        "default": row["config"], "default_us": row["gemv_us"],
        "best": list(best), "best_us": best_us, "floor_us": row["floor_us"],
        "top5": [[list(c), t] for t, c in times[:5]],
    }  # fmt: skip
    sweep.append(entry)
    print(
        f"sweep {row['shape']:<14} {row['weights']:>4} M={row['m']:<2} best {tuple(best)} "
        f"{best_us:7.2f} us ({best_us / row['floor_us']:.2f}x floor), default "
        f"{tuple(row['config'])} {row['gemv_us']:7.2f} us",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--weights", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    ap.add_argument("--iters", type=int, default=20, help="calls per graph (at least one per copy)")
    ap.add_argument("--sweep-configs", action="store_true", help="also time tile choices")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gemv.py needs a CUDA GPU")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows, sweep = [], []
    for name in args.shapes:
        bench_shape(name, args, bandwidth, rows, sweep)
    print(f"device: {torch.cuda.get_device_name()}  copy BW {bandwidth / 1e12:.2f} TB/s")
    print(f"{'shape':<14} {'w':>4} {'M':>2} {'N':>6} {'K':>6} {'gemv us':>8} {'base us':>8} "
          f"{'base':<18} {'floor us':>8} {'gemv/floor':>10} {'base/floor':>10} {'speedup':>7}")  # fmt: skip
    for r in rows:
        print(
            f"{r['shape']:<14} {r['weights']:>4} {r['m']:>2} {r['n']:>6} {r['k']:>6} "
            f"{r['gemv_us']:>8.2f} {r['base_us']:>8.2f} {r['base']:<18} {r['floor_us']:>8.2f} "
            f"{r['gemv_vs_floor']:>10.2f} {r['base_vs_floor']:>10.2f} {r['speedup']:>7.2f}"
        )
    print(
        json.dumps(
            {
                "bench": "gemv",
                "device": torch.cuda.get_device_name(),
                "copy_bandwidth_tbs": bandwidth / 1e12,
                "rows": rows,
                "sweep": sweep,
            }
        )
    )


if __name__ == "__main__":
    main()
