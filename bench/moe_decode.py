"""One MoE layer at decode and verify sizes: the decode kernels (`mlaserve/ops/moe_decode.py`)
and the grouped kernels (`mlaserve/ops/moe_grouped.py`) vs the sorted grouped-GEMM path + shared
MLP they replace, against the layer's bytes floor.

    python3 bench/moe_decode.py [--tokens 1 2 4 8 16 32 64 128 256] [--iters 20] [--sweep]
    python3 bench/moe_decode.py --arch v3tp2 --weights fp8 --tokens 1 2 4 8 --sweep

DeepSeek-V2-Lite's MoE layer (hidden 2048, 64 experts top-6 softmax, 2 shared, width 1408), or
with `--arch v3tpN` one tensor-parallel rank's share of a DeepSeek-V3 layer at TP N = 2, 4, 8
(hidden 7168, 256 experts top-8 sigmoid in 8 groups, 1 shared, width 2048 / N: the shapes each
rank's kernels see), random weights, bf16 and FP8 (block scales). `--layers` distinct layers are called in turn so
that no expert stays in L2 between calls (one layer's experts are 1.1 GB in bf16). Each variant
runs `--iters` calls captured in one CUDA graph, timed with CUDA events (median of 5 replays, `bench/fusions.py`'s timer):
GPU time per layer call, routing included, launch overhead excluded, as in the decode graph.
The decode kernels are timed up to DECODE_TIMED_MAX tokens (past that they only lose).

floor = bytes the call must read (router + shared experts + the distinct routed experts its
tokens chose, in the weights' dtype) / device copy bandwidth measured in this run. `--sweep`
also times the kernels' tile choices at each token count.

Prints tables and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth
from fusions import graph_time_us
from tp_decode import V3_WIDTH

from mlaserve.config import ModelConfig, QuantizationConfig
from mlaserve.model.layers.moe import DeepseekMoE
from mlaserve.ops.moe_decode import FP8_RUN, moe_decode
from mlaserve.ops.moe_grouped import moe_grouped

V2LITE = {
    "vocab_size": 1024,
    "hidden_size": 2048,
    "num_hidden_layers": 1,
    "num_attention_heads": 16,
    "kv_lora_rank": 512,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408,
    "model_type": "deepseek_v2",
    "topk_method": "greedy",
}
# One TP2 rank's share of V3's MoE layer: `tp_decode`'s V3 width, its experts' width halved.
V3_MOE_KEYS = ("hidden_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
               "model_type", "topk_method", "scoring_func", "n_group", "topk_group",
               "norm_topk_prob", "routed_scaling_factor")  # fmt: skip
V3_TP2 = {
    **V2LITE,
    **{key: V3_WIDTH[key] for key in V3_MOE_KEYS},
    "moe_intermediate_size": V3_WIDTH["moe_intermediate_size"] // 2,
}
ARCHS = {
    "v2lite": V2LITE,
    **{
        f"v3tp{n}": {**V3_TP2, "moe_intermediate_size": V3_WIDTH["moe_intermediate_size"] // n}
        for n in (2, 4, 8)
    },
}
REPS = 5  # timed replays of each captured graph (median)
# decode kernels: (block_n, num_warps, block_k) of (gate_up, down); FP8 takes a block_k over
# 128 only with block_n dividing 128 (moe_decode's uniform scales)
TILES = [
    ((16, 16), 8, (128, 128)),
    ((16, 16), 4, (128, 128)),
    ((8, 8), 4, (512, 512)),
    ((16, 16), 4, (256, 256)),
    ((4, 4), 4, (2048, 2048)),
    ((2, 2), 4, (2048, 2048)),
    ((4, 4), 8, (2048, 2048)),
    ((8, 8), 4, (2048, 2048)),
    ((4, 4), 2, (2048, 2048)),
    ((2, 2), 2, (2048, 2048)),
    ((4, 8), 4, (2048, 1024)),
    ((4, 4), 4, (2048, 1024)),
    ((4, 16), 4, (2048, 256)),
    ((1, 1), 4, (2048, 2048)),
]
# ... and for layers wider than one FP8 run (V3's hidden 7168): few rows a program with the whole
# K, or half of it, a step, as `ops/gemv.py`'s long-K tile (2 rows x 8192 columns); the first two
# are `decode_tiles`' shipped ones there (TP2's and TP4's expert width)
LONG_K_TILES = [
    ((4, 16), 4, (8192, 1024)),
    ((4, 16), 4, (8192, 512)),
    ((2, 16), 4, (8192, 1024)),
    ((1, 8), 4, (8192, 1024)),
    ((1, 8), 8, (8192, 1024)),
    ((2, 8), 8, (8192, 1024)),
    ((1, 4), 4, (4096, 1024)),
    ((2, 4), 4, (4096, 1024)),
    ((2, 8), 4, (4096, 1024)),
    ((2, 16), 8, (4096, 512)),
]
# grouped kernels: (block_n, num_warps, num_stages, block_m, block_k; None: the default)
GROUPED_TILES = [
    (None, 4, None, None, None),  # the launcher's defaults
    ((64, 64), 4, 3, None, None),
    ((32, 32), 4, 3, None, None),
    ((64, 64), 4, 4, None, None),
    ((128, 128), 4, 3, None, None),
    ((64, 64), 8, 3, None, None),
    ((64, 64), 4, 3, 32, None),
    ((32, 32), 4, 3, 32, None),
    ((32, 32), 4, 4, None, None),
    ((32, 32), 4, 5, None, None),
    ((32, 32), 2, 3, None, None),
    ((32, 32), 4, 3, None, 128),
    ((32, 32), 4, 4, None, 128),
    ((32, 64), 4, 3, None, None),
    ((64, 32), 4, 3, None, None),
    ((16, 16), 4, 3, None, None),
    ((16, 16), 2, 4, None, None),
    ((16, 64), 4, 4, None, None),
    ((32, 64), 4, 5, None, None),
    ((32, 128), 4, 4, None, None),
    ((16, 128), 4, 4, None, None),
    # prefill-sized batches (past GROUPED_MAX_TOKENS): tensor-core tiles
    ((128, 128), 8, 3, 64, 64),
    ((128, 128), 4, 4, 64, 64),
    ((128, 128), 8, 3, 128, 64),
    ((128, 128), 8, 4, 128, 32),
    ((64, 128), 4, 4, 64, 64),
    ((128, 64), 4, 4, 64, 64),
]
# the grouped kernels' default tiles with the gate / up GEMM's K split 1..8 ways (`gate_up_split`)
SPLITS = (1, 2, 4, 7, 8)
DECODE_TIMED_MAX = 32
# (decode_max_tokens, grouped_max_tokens) of each variant
MODES = {"unfused": (0, 0), "decode": (1 << 20, 0), "grouped": (0, 1 << 20)}


def make_layer(config: ModelConfig, fp8: bool, seed: int) -> DeepseekMoE:
    g = torch.Generator(device="cuda").manual_seed(seed)
    quant = QuantizationConfig() if fp8 else None
    with torch.device("cuda"):
        layer = DeepseekMoE(config, params_dtype=torch.bfloat16, quant=quant)
    for name, p in layer.named_parameters():
        if p.dtype == torch.float8_e4m3fn:  # random codes below 0x70: finite, |x| < 256
            p.data.view(torch.uint8).copy_(torch.randint_like(p.data.view(torch.uint8), 0, 0x70))
            p.data.view(torch.uint8)[..., ::2] |= 0x80  # half of them negative
        elif name.endswith("scale_inv"):
            p.data.fill_(1e-3)
        else:
            p.data.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    layer.process_weights_after_loading()
    assert layer.decode_weights is not None, "decode kernels off (MLASERVE_* env?)"
    return layer


def in_turn(fn, n: int):
    """A no-argument call of fn(0), fn(1), ..., fn(n - 1), fn(0), ... in turn (warm-up and
    capture included): one layer after another, so none stays in L2."""
    turn = itertools.count()
    return lambda: fn(next(turn) % n)


def floor_us(layers: list[DeepseekMoE], xs: list[torch.Tensor], bandwidth: float) -> float:
    """Mean over the layers of (router + shared + distinct routed experts' bytes) / bandwidth."""
    total = 0
    for layer, x in zip(layers, xs, strict=True):
        ids = layer.gate(x)[1]
        experts, shared = layer.experts, layer.shared_experts
        per_expert = sum(
            t[0].numel() * t.element_size() for t in (experts.gate_up_proj, experts.down_proj)
        )
        per_expert += sum(
            t[0].numel() * t.element_size()
            for t in (experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv)
            if t is not None
        )
        total += ids.unique().numel() * per_expert
        total += layer.gate.weight.numel() * 4
        total += sum(p.numel() * p.element_size() for p in shared.parameters())
    return total / len(layers) / bandwidth * 1e6


def bench_weights(
    config: ModelConfig, fp8: bool, args: argparse.Namespace, bandwidth: float, rows, sweep
) -> None:
    """Every token count for one weight format; appends to `rows` (and `sweep`)."""
    layers = [make_layer(config, fp8, seed) for seed in range(args.layers)]
    for tokens in args.tokens:
        xs = [
            torch.randn(tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16)
            for _ in layers
        ]

        def call(i, mode, xs=xs):
            layers[i].decode_max_tokens, layers[i].grouped_max_tokens = MODES[mode]
            return layers[i](xs[i])

        row = {"weights": "fp8" if fp8 else "bf16", "tokens": tokens}
        for mode in MODES:
            if mode != "decode" or tokens <= DECODE_TIMED_MAX:
                fn = in_turn(lambda i, mode=mode: call(i, mode), len(layers))
                row[mode + "_us"] = graph_time_us(fn, args.iters, REPS)
        row["floor_us"] = floor_us(layers, xs, bandwidth)
        best = min(row.get("decode_us", float("inf")), row["grouped_us"])
        row["speedup"] = row["unfused_us"] / best
        row["fused_vs_floor"] = best / row["floor_us"]
        row["unfused_vs_floor"] = row["unfused_us"] / row["floor_us"]
        rows.append(row)
        if not args.sweep:
            continue
        routed = [layer.gate(x) for layer, x in zip(layers, xs, strict=True)]
        long_k = LONG_K_TILES if config.hidden_size > FP8_RUN else []
        tiles = [("decode", *t) for t in TILES + long_k]
        tiles = tiles if tokens <= DECODE_TIMED_MAX else []
        tiles += [("grouped", *t) for t in GROUPED_TILES]
        tiles += [("split", k) for k in SPLITS if config.hidden_size % (128 * k) == 0]
        for tile in tiles:

            def run(j, tile=tile, xs=xs, routed=routed):
                w, ids = routed[j]
                if tile[0] == "split":  # the default tiles, the gate / up GEMM split k ways
                    return moe_grouped(xs[j], w, ids, layers[j].decode_weights, split=tile[1])
                if tile[0] == "decode":
                    _, block_n, warps, block_k = tile
                    return moe_decode(
                        xs[j], w, ids, layers[j].decode_weights, block_n=block_n,
                        block_k=block_k, num_warps=warps,
                    )  # fmt: skip
                _, block_n, warps, stages, block_m, block_k = tile
                return moe_grouped(
                    xs[j], w, ids, layers[j].decode_weights, block_n=block_n,
                    num_warps=warps, num_stages=stages, block_m=block_m, block_k=block_k,
                )  # fmt: skip

            sweep.append(
                {
                    "weights": row["weights"],
                    "tokens": tokens,
                    "tile": [str(v) for v in tile],
                    "kernels_us": graph_time_us(in_turn(run, len(layers)), args.iters, REPS),
                }
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 64, 128, 256])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="v2lite")
    ap.add_argument("--weights", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    args = ap.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    config = ModelConfig.from_dict(ARCHS[args.arch])
    rows, sweep = [], []
    for fp8 in (w == "fp8" for w in args.weights):
        bench_weights(config, fp8, args, bandwidth, rows, sweep)
        torch.cuda.empty_cache()
    print(f"device: {torch.cuda.get_device_name()}  layer {args.arch}  copy BW "
          f"{bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    print(f"{'weights':>7} {'T':>3} {'unfused us':>10} {'decode us':>9} {'grouped us':>10} "
          f"{'speedup':>7} {'floor us':>8} {'fused/floor':>11} {'unfused/floor':>13}")  # fmt: skip
    for r in rows:
        decode = f"{r['decode_us']:>9.1f}" if "decode_us" in r else f"{'-':>9}"
        print(
            f"{r['weights']:>7} {r['tokens']:>3} {r['unfused_us']:>10.1f} {decode} "
            f"{r['grouped_us']:>10.1f} {r['speedup']:>7.2f} {r['floor_us']:>8.1f} "
            f"{r['fused_vs_floor']:>11.2f} {r['unfused_vs_floor']:>13.2f}"
        )
    if sweep:
        print("\ntiles (kernels alone, routing excluded): us")
        for s in sweep:
            print(f"{s['weights']:>7} T {s['tokens']:>3} {' '.join(s['tile'])}: "
                  f"{s['kernels_us']:.1f}")  # fmt: skip
    print(
        json.dumps(
            {
                "bench": "moe_decode",
                "device": torch.cuda.get_device_name(),
                "arch": args.arch,
                "copy_bandwidth_tbs": bandwidth / 1e12,
                "rows": rows,
                "sweep": sweep,
            }
        )
    )


if __name__ == "__main__":
    main()
