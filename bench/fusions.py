"""Each fused decode kernel (`mlaserve/ops/`) vs the torch code it replaces, at V2-Lite shapes.

    python3 bench/fusions.py [--batch-sizes 1,8,64] [--iters 50]

Shapes: hidden 2048, 16 heads, latent 512 + rope 64 (qk_nope 128), 64 routed experts top-6
(softmax, greedy; plus V3's 256-expert sigmoid noaux_tc router for reference), shared-expert
intermediate 2816, fp8 KV with page 64. Each op runs `--iters` times inside one CUDA graph; the
replay is timed with CUDA events and divided by `--iters` (median of `--reps` replays), so the
numbers are GPU time per call without launch overhead, as inside the captured decode step.
`per_layer` sums what one MoE decode layer of V2-Lite runs with the fusions on: two add + norms
(the residual add is fused into the next norm), the latent norm + RoPE + KV write, the q prep,
the routing and the shared experts' SiLU-and-mul; the unfused column is the torch code each
replaces (kv_write, latent_norm_rope and rms_norm alone are shown but not summed).

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch

from mlaserve.kv_cache.kv_pool import MLAKVPool
from mlaserve.model.layers.mlp import silu_and_mul
from mlaserve.model.layers.moe import select_experts
from mlaserve.model.layers.norm import RMSNorm
from mlaserve.model.layers.rotary import apply_rope
from mlaserve.ops.kv_write import write_kv
from mlaserve.ops.mla_norm_rope import mla_norm_rope
from mlaserve.ops.q_prep import prepare_q
from mlaserve.ops.routing import fused_select_experts
from mlaserve.ops.silu_and_mul import silu_and_mul as fused_silu_and_mul

HIDDEN, HEADS, RANK, NOPE, ROPE = 2048, 16, 512, 128, 64
SHARED_INTER, PAGE = 2816, 64
V2LITE_ROUTER = dict(
    top_k=6,
    scoring_func="softmax",
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
)
V3_ROUTER = dict(
    top_k=8,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)


def graph_time_us(fn: Callable[[], object], iters: int, reps: int) -> float:
    """GPU microseconds per call of `fn`, captured `iters` times in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # JIT-compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def make_norm(n: int, fused: bool, dev: str) -> RMSNorm:
    os.environ["MLASERVE_FUSED_OPS"] = "1" if fused else "0"
    try:
        norm = RMSNorm(n, 1e-6, params_dtype=torch.bfloat16).to(dev)
    finally:
        del os.environ["MLASERVE_FUSED_OPS"]
    assert norm.fused == fused
    return norm


def cases(
    bs: int, dev: str = "cuda"
) -> dict[str, tuple[Callable[[], object], Callable[[], object], int]]:
    """op -> (unfused, fused, calls per decode layer)."""
    bf16 = torch.bfloat16
    x = torch.randn(bs, HIDDEN, device=dev, dtype=bf16)
    res = torch.randn(bs, HIDDEN, device=dev, dtype=bf16)
    ref_norm, fused_norm = make_norm(HIDDEN, False, dev), make_norm(HIDDEN, True, dev)
    ref_latent_norm = make_norm(RANK, False, dev)

    kv = torch.randn(bs, RANK + ROPE, device=dev, dtype=bf16)
    kv_c, k_pe = kv.split([RANK, ROPE], dim=-1)
    q = torch.randn(bs, HEADS, NOPE + ROPE, device=dev, dtype=bf16)
    q_pe = q[..., NOPE:]
    q_latent = torch.randn(HEADS, bs, RANK, device=dev, dtype=bf16).transpose(0, 1)
    pos = torch.randint(0, 4096, (bs,), device=dev)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, device=dev).float() / ROPE))
    freqs = pos[:, None].float() * inv_freq
    cos, sin = freqs.cos(), freqs.sin()

    pages = bs * 4096 // PAGE + 2
    pool = MLAKVPool(1, pages, PAGE, RANK, ROPE, torch.float8_e4m3fn, dev)
    slots = torch.randperm(pages * PAGE - PAGE, device=dev)[:bs] + PAGE
    flat = pool.kv_buffers[0].view(-1, RANK + ROPE)

    def ref_write():
        rows = pool.quantize(torch.cat([kv_c, k_pe], dim=-1), 0)
        flat.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))

    def ref_q():
        return torch.cat([q_latent, q_pe], -1).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def ref_norm_rope():
        return (
            ref_latent_norm(kv_c),
            apply_rope(k_pe, cos, sin, True),
            apply_rope(q_pe, cos, sin, True),
        )

    def ref_norm_rope_write():
        c, k, qr = ref_norm_rope()
        rows = pool.quantize(torch.cat([c, k], dim=-1), 0)
        flat.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
        return qr

    def fused_norm_rope_write():
        w = ref_latent_norm.weight
        buf = pool.kv_buffers[0]
        return mla_norm_rope(kv_c, k_pe, q_pe, w, 1e-6, cos, sin, True, buf, slots, 1.0)

    def ref_add_norm():
        s = res + x
        return ref_norm(s), s

    gate_w = torch.randn(64, HIDDEN, device=dev)
    logits = torch.nn.functional.linear(x.float(), gate_w)
    logits_v3 = torch.randn(bs, 256, device=dev)
    bias = torch.randn(256, device=dev) * 0.1
    gate_up = torch.randn(bs, 2 * SHARED_INTER, device=dev, dtype=bf16)

    return {
        "kv_write": (ref_write, lambda: write_kv(pool.kv_buffers[0], slots, kv_c, k_pe, 1.0), 0),
        "q_prep": (ref_q, lambda: prepare_q(q_latent, q_pe, torch.float8_e4m3fn), 1),
        "latent_norm_rope": (
            ref_norm_rope,
            lambda: mla_norm_rope(kv_c, k_pe, q_pe, ref_latent_norm.weight, 1e-6, cos, sin, True),
            0,
        ),
        "latent_norm_rope_write": (ref_norm_rope_write, fused_norm_rope_write, 1),
        "rms_norm": (lambda: ref_norm(x), lambda: fused_norm(x), 0),
        "add_rms_norm": (ref_add_norm, lambda: fused_norm.forward_with_residual(x, res), 2),
        "routing_v2lite": (
            lambda: select_experts(logits, **V2LITE_ROUTER),
            lambda: fused_select_experts(logits, **V2LITE_ROUTER),
            1,
        ),
        "routing_v3": (
            lambda: select_experts(logits_v3, correction_bias=bias, **V3_ROUTER),
            lambda: fused_select_experts(logits_v3, correction_bias=bias, **V3_ROUTER),
            0,
        ),
        "silu_and_mul_shared": (
            lambda: silu_and_mul(gate_up),
            lambda: fused_silu_and_mul(gate_up),
            1,
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_default_device("cuda")
    results = []
    print(f"{'op':<22}{'bs':>4}{'unfused us':>12}{'fused us':>10}{'speedup':>9}")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        layer_ref = layer_fused = 0.0
        for name, (ref, fused, per_layer) in cases(bs).items():
            t_ref = graph_time_us(ref, args.iters, args.reps)
            t_fused = graph_time_us(fused, args.iters, args.reps)
            layer_ref += per_layer * t_ref
            layer_fused += per_layer * t_fused
            results.append({"op": name, "bs": bs, "unfused_us": t_ref, "fused_us": t_fused})
            print(f"{name:<22}{bs:>4}{t_ref:>12.2f}{t_fused:>10.2f}{t_ref / t_fused:>8.1f}x")
        results.append(
            {"op": "per_layer", "bs": bs, "unfused_us": layer_ref, "fused_us": layer_fused}
        )
        print(f"{'per_layer':<22}{bs:>4}{layer_ref:>12.2f}{layer_fused:>10.2f}"
              f"{layer_ref / layer_fused:>8.1f}x")  # fmt: skip
    print(
        json.dumps({"bench": "fusions", "device": torch.cuda.get_device_name(), "results": results})
    )


if __name__ == "__main__":
    main()
