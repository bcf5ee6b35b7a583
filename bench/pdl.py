"""Programmatic dependent launch: a decode-sized chain of our Triton kernels in one CUDA graph,
launched with and without PDL (`mlaserve/ops/pdl.py`), side by side in one run.

    python3 bench/pdl.py [--layers 27] [--tokens 1 8 32]

Per "layer" (V2-Lite's hidden size 2048): residual-add + RMSNorm, a 2048 -> 3648 GEMV (the
merged q | kv_a projection's shape), a GEMV back to 2048 from the first 2048 columns' worth of
weight (o_proj's shape), residual-add + RMSNorm again and, with `--bmm`, one cuBLAS bmm (a library
kernel without PDL between two PDL kernels, like W_UK's). Every layer has its own weights, so
they stream from HBM as in a real step. Columns: graph replay time (CUDA events, median of
`--iters`), the bytes floor (weights read / measured copy bandwidth) and the outputs' agreement
(PDL on vs off must be bit-identical: the kernels and their order are the same).

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from decode import copy_bandwidth

from mlaserve.ops.gemv import gemv
from mlaserve.ops.pdl import pdl_launch
from mlaserve.ops.rms_norm import add_rms_norm

HIDDEN, QKV = 2048, 3648


def make_layers(n: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16)

    return [
        {
            "n1": 1 + rand(HIDDEN),
            "n2": 1 + rand(HIDDEN),
            "w_qkv": rand(QKV, HIDDEN),
            "w_o": rand(HIDDEN, HIDDEN),
            "w_uk": rand(16, 128, 512),
        }
        for _ in range(n)
    ]


def chain(x: torch.Tensor, layers: list[dict[str, torch.Tensor]], bmm: bool) -> torch.Tensor:
    res = x
    for lw in layers:
        h, res = add_rms_norm(x, res, lw["n1"], 1e-6)
        qkv = gemv(h, lw["w_qkv"])
        if bmm:  # a cuBLAS kernel between two of ours: [16, T, 128] @ [16, 128, 512]
            q = qkv[:, : 16 * 128].view(-1, 16, 128).transpose(0, 1)
            lat = torch.bmm(q, lw["w_uk"])  # [16, T, 512]
            a = lat.transpose(0, 1).reshape(-1, 16 * 512)[:, :HIDDEN].contiguous()
        else:
            a = qkv[:, :HIDDEN].contiguous()
        o = gemv(a, lw["w_o"])
        h, res = add_rms_norm(o, res, lw["n2"], 1e-6)
        x = h
    return x + res


def replay_ms(
    x: torch.Tensor, layers: list[dict[str, torch.Tensor]], bmm: bool, iters: int
) -> tuple[float, torch.Tensor]:
    pdl_launch.cache_clear()  # MLASERVE_PDL was just set: launches read it again
    for _ in range(2):  # compile (this PDL setting is its own compile) and warm up
        chain(x, layers, bmm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, layers, bmm)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), out.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    layers = make_layers(args.layers, device)
    weight_bytes = sum(
        t.numel() * t.element_size() for lw in layers for k, t in lw.items() if k != "w_uk"
    )
    print(f"device: {torch.cuda.get_device_name()}  copy BW {bw / 1e12:.2f} TB/s  "
          f"layers {args.layers}  kernels/layer 4 (+1 cuBLAS bmm in the bmm rows)")  # fmt: skip
    print(" T   bmm  off ms   on ms  on/off  floor ms off/floor on/floor  same bits")
    rows = []
    for bmm in (False, True):
        floor = (weight_bytes + (bmm * args.layers * 16 * 128 * 512 * 2)) / bw * 1e3
        for t in args.tokens:
            x = torch.randn(t, HIDDEN, device=device).to(torch.bfloat16)
            os.environ["MLASERVE_PDL"] = "0"
            off, out_off = replay_ms(x, layers, bmm, args.iters)
            os.environ["MLASERVE_PDL"] = "1"
            on, out_on = replay_ms(x, layers, bmm, args.iters)
            same = bool(torch.equal(out_off, out_on))
            print(
                f"{t:2d} {bmm!s:>5} {off:7.3f} {on:7.3f} {on / off:7.3f} {floor:9.3f} "
                f"{off / floor:9.2f} {on / floor:8.2f}  {same}"
            )
            rows.append(
                {"tokens": t, "bmm": bmm, "off_ms": off, "on_ms": on, "floor_ms": floor,
                 "same_bits": same}
            )  # fmt: skip
    os.environ.pop("MLASERVE_PDL")
    print(json.dumps({"bench": "pdl", "device": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
