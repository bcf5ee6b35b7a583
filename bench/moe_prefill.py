"""Prefill-sized MoE glue and the routed experts' gate_up GEMM: `mlaserve/ops/moe_prefill_gemm.py`
(Triton, x's gather and SiLU-and-mul inside) vs the path it replaces (gather,
`torch._grouped_mm`, `silu_and_mul`), against the GEMM's floor; with `--glue` also the router
logits, the selection and the sort (`ops/expert_sort.py` vs torch's) at each size.

    python3 bench/moe_prefill.py [--tokens 1024 2048 4096 8192] [--sweep] [--glue]

DeepSeek-V2-Lite's experts (hidden 2048, 64 experts top-6, width 1408), random bf16 weights,
routing by top-6 of random logits. `--layers` distinct expert sets are called in turn so none
stays in L2 (one set is 1.1 GB). Each variant is captured `--iters` times in one CUDA graph
(`bench/fusions.py`'s timer, median of 5 replays): GPU us per call.

floor = max(bytes of the experts the tokens touched / measured copy bandwidth, FLOPs / measured
bf16 matmul rate). The down GEMM (`torch._grouped_mm`, kept) is timed beside its floor.
`--sweep` also times the gate_up kernel's tile choices.

Prints tables and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth
from fusions import graph_time_us
from prefill import matmul_rate

from mlaserve.ops.moe_prefill_gemm import DEFAULT_TILES, PrefillGemmTiles, expert_gate_up_silu
from mlaserve.ops.silu_and_mul import silu_and_mul

H, INTER, E, K = 2048, 1408, 64, 6
SWEEP = [  # (block_m, block_n, block_k, num_warps, num_stages)
    PrefillGemmTiles(64, 64, 64, 4, 3),
    PrefillGemmTiles(128, 64, 64, 8, 3),
    PrefillGemmTiles(128, 64, 64, 4, 3),
    PrefillGemmTiles(128, 64, 64, 8, 2),
    PrefillGemmTiles(128, 128, 64, 8, 3),
    PrefillGemmTiles(64, 128, 64, 4, 3),
]
V2LITE_SELECTION = {
    "top_k": K, "scoring_func": "softmax", "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
}  # fmt: skip
V3_SELECTION = {
    "top_k": 8, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
}  # fmt: skip


def routing(tokens: int, dev: torch.device, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.randn(tokens, E, device=dev, generator=g)
    ids = logits.topk(K, dim=1).indices
    flat = ids.reshape(-1)
    order = torch.argsort(flat.to(torch.uint8), stable=True)
    counts = torch.bincount(flat, minlength=E).to(torch.int32)
    return order, counts, int((counts > 0).sum())


def in_turn(fn, n: int):
    i = [0]

    def call():
        fn(i[0] % n)
        i[0] += 1

    return call


def torch_sort(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The sorted path's torch form (`FusedExperts._forward_sorted` past the kernel's limit)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat.to(torch.uint8), stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, order // K, counts


def glue_row(t: int, dev: torch.device, gates: list[torch.Tensor]) -> dict:
    """Router logits, the selection (V2-Lite's and V3's) and the sort at t tokens, us."""
    from mlaserve.ops.expert_sort import sort_by_expert
    from mlaserve.ops.router_logits import router_logits
    from mlaserve.ops.routing import fused_select_experts

    x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
    logits = router_logits(x, gates[0])
    logits_v3 = torch.randn(1, t, 256, device=dev)
    bias = torch.randn(256, device=dev) / 10
    ids = fused_select_experts(logits, **V2LITE_SELECTION)[1]
    sort = sort_by_expert(ids, E)
    return {
        "tokens": t,
        "router": graph_time_us(in_turn(lambda i: router_logits(x, gates[i]), 4), 8, 5),
        "routing": graph_time_us(lambda: fused_select_experts(logits, **V2LITE_SELECTION), 8, 5),
        "routing_v3": graph_time_us(
            lambda: fused_select_experts(logits_v3, **V3_SELECTION, correction_bias=bias), 8, 5
        ),
        "sort_torch": graph_time_us(lambda: torch_sort(ids), 8, 5),
        "sort_kernel": graph_time_us(lambda: sort_by_expert(ids, E), 8, 5),
        "sort_equal": torch.equal(sort.order, torch_sort(ids)[0]),
    }


def gemm_row(t: int, dev: torch.device, w13, w2, bw: float, rate: float, args) -> dict:
    """The gate_up GEMM's torch path vs the kernel at t tokens (and the tiles with --sweep)."""
    n = args.layers
    x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
    order, counts, touched = routing(t, dev, t)
    offs = counts.cumsum(0, dtype=torch.int32)
    r = t * K
    gu_floor = max(touched * 2 * INTER * H * 2 / bw, 2 * r * 2 * INTER * H / rate) * 1e6
    dn_floor = max(touched * H * INTER * 2 / bw, 2 * r * H * INTER / rate) * 1e6

    def torch_gate_up(i):
        return silu_and_mul(torch._grouped_mm(x[order // K], w13[i].transpose(1, 2), offs=offs))

    def time(fn):
        return graph_time_us(in_turn(fn, n), args.iters, 5)

    h_ref = torch_gate_up(0)
    h_new = expert_gate_up_silu(x, order, counts, w13[0])
    diff = ((h_new.float() - h_ref.float()).abs().max() / h_ref.float().abs().max()).item()
    row = {
        "tokens": t, "gate_up_floor": gu_floor, "gate_up_torch": time(torch_gate_up),
        "gate_up_fused": time(lambda i: expert_gate_up_silu(x, order, counts, w13[i])),
        "down_floor": dn_floor,
        "down_torch": time(lambda i: torch._grouped_mm(h_ref, w2[i].transpose(1, 2), offs=offs)),
        "max_rel_diff": diff, "sweep": {},
    }  # fmt: skip
    for tiles in SWEEP if args.sweep else []:
        row["sweep"][str(tuple(tiles))] = time(
            lambda i, c=tiles: expert_gate_up_silu(x, order, counts, w13[i], tiles=c)
        )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--glue", action="store_true", help="also time the routing and the sort")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw, rate = copy_bandwidth(dev), matmul_rate(dev)
    print(
        f"device: {torch.cuda.get_device_name(dev)}  copy BW {bw / 1e12:.2f} TB/s  "
        f"bf16 matmul {rate / 1e12:.0f} TFLOP/s  V2-Lite experts, {args.layers} sets in turn"
    )
    glue_rows = []
    if args.glue:
        gates = [torch.randn(E, H, device=dev) / 45 for _ in range(4)]
        print("tokens  router  routing  routing(V3)  sort: torch  kernel  equal   (us)")
        for t in args.tokens:
            g = glue_row(t, dev, gates)
            glue_rows.append(g)
            print(
                f"{t:6d}  {g['router']:6.1f}  {g['routing']:7.1f}  {g['routing_v3']:11.1f}"
                f"  {g['sort_torch']:11.1f}  {g['sort_kernel']:6.1f}  {g['sort_equal']}",
                flush=True,
            )
    w13 = [torch.randn(E, 2 * INTER, H, device=dev, dtype=torch.bfloat16) / 45]
    w2 = [torch.randn(E, H, INTER, device=dev, dtype=torch.bfloat16) / 38]
    for _ in range(args.layers - 1):
        w13.append(torch.randn_like(w13[0]) / 45)
        w2.append(torch.randn_like(w2[0]) / 38)
    print(
        "tokens  gate_up floor  gather+GEMM+silu  fused  fused/torch  |  down floor  down torch"
        "   max|diff|/max|ref|   (us)"
    )
    rows = []
    for t in args.tokens:
        r = gemm_row(t, dev, w13, w2, bw, rate, args)
        rows.append(r)
        print(
            f"{t:6d}  {r['gate_up_floor']:13.1f}  {r['gate_up_torch']:16.1f}"
            f"  {r['gate_up_fused']:5.1f}  {r['gate_up_fused'] / r['gate_up_torch']:11.3f}"
            f"  |  {r['down_floor']:10.1f}  {r['down_torch']:10.1f}   {r['max_rel_diff']:.2e}",
            flush=True,
        )
        for tiles, us in r["sweep"].items():
            mark = "  (default)" if tiles == str(tuple(DEFAULT_TILES)) else ""
            print(f"    {tiles}: {us:7.1f} us{mark}", flush=True)
    print(json.dumps({"bench": "moe_prefill", "device": torch.cuda.get_device_name(dev),
                      "copy_bw": bw, "matmul_rate": rate, "rows": rows, "glue": glue_rows}))  # fmt: skip


if __name__ == "__main__":
    main()
