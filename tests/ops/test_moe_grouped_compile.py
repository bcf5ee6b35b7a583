"""The MoE kernels (grouped, decode and the sorted path's combine) and the router-logits kernel compile for SM90 (H100) and
SM100 (B200) without either GPU.

Triton's ahead-of-time path (`triton.compile` with a `GPUTarget`) lowers each kernel to a cubin,
so what the interpreter lets through but the compiler refuses (a variable whose type changes in
a branch, a tl.dot shape, an fp8 cast) fails on a CPU machine. Every block size the launcher
picks, bf16 and FP8 weights, V2-Lite's shape. In a subprocess: TRITON_INTERPRET must not leak.
"""

from __future__ import annotations

import pytest

from tests.aot_compile import compile_for_gpus

pytest.importorskip("triton")

CASES = r"""
from mlaserve.ops import moe_decode as D
from mlaserve.ops import moe_grouped as M
from mlaserve.ops import moe_sorted_combine as C
from mlaserve.ops import router_logits as R

index = {"slot_pairs_ptr": "*i32", "padded_end_ptr": "*i32", "counts_ptr": "*i32"}
sig = signature(M._align_kernel, {**index, "ids_ptr": "*i64", "rank_ptr": "*i32"},
                constexprs=("K", "SLOTS", "E", "E_TOTAL", "E_PAD", "NP", "BLOCK_M"))
cases.append(("align", M._align_kernel, sig,
              dict(K=6, SLOTS=8, E=64, E_TOTAL=66, E_PAD=128, NP=2048, BLOCK_M=16)))
shape = dict(H=2048, INTER=1408, SLOTS=8, E=64, S=2, E_PAD=128)
for wt, scaled in (("*bf16", False), ("*fp8e4nv", True)):
    ptrs = {**index, "w_ptr": wt, "sw_ptr": wt, "s_ptr": "*fp32", "ss_ptr": "*fp32"}
    tiles = dict(HAS_SCALE=scaled, BLOCK_N=64, BLOCK_K=128 if scaled else 64)
    for bm in (16, 32, 64):
        for split in (1, 2):  # unsplit, and the K split's partials, counters and last-arrival sum
            gu = dict(**shape, **tiles, ROW_DIV=128, SHARED_ROW_DIV=128, BLOCK_M=bm,
                      SPLIT=split, K_PER=shape["H"] // split)
            sig = signature(M._gate_up_kernel, {**ptrs, "x_ptr": "*bf16", "h_ptr": "*bf16",
                            "ws_ptr": "*fp32", "cnt_ptr": "*i32"}, constexprs=gu)
            cases.append((f"gate_up_{wt[1:]}_{bm}_split{split}", M._gate_up_kernel, sig, gu))
        dn = dict(**shape, **tiles, K=6, BLOCK_M=bm)
        sig = signature(M._down_kernel,
                        {**ptrs, "h_ptr": "*bf16", "wts_ptr": "*fp32", "part_ptr": "*fp32"},
                        constexprs=dn)
        cases.append((f"down_{wt[1:]}_{bm}", M._down_kernel, sig, dn))
    # moe_decode's kernels share the expert row / column helpers with the grouped ones
    ptrs = {"ids_ptr": "*i64", "w_ptr": wt, "sw_ptr": wt, "s_ptr": "*fp32", "ss_ptr": "*fp32"}
    select = {"wts_ptr": "*fp32", "logits_ptr": "*fp32", "bias_ptr": "*fp32"}
    # the selection inside the gate_up kernel: off, V2-Lite's (softmax, greedy top-6 of 64) and
    # V3's (sigmoid + bias, 8 groups, top-4 groups, top-8 of 256)
    v2 = dict(SPLITS=1, G=1, PG=64, TOPK_GROUP=1, BLOCK_G=1, BLOCK_PG=64, BLOCK_K_SEL=8,
              METHOD=0, SIGMOID=False, HAS_BIAS=False, NORM=False)
    routes = {"off": dict(v2, ROUTE=False), "v2": dict(v2, ROUTE=True),
              "v3": dict(v2, ROUTE=True, G=8, PG=32, TOPK_GROUP=4, BLOCK_G=8, BLOCK_PG=32,
                         METHOD=2, SIGMOID=True, HAS_BIAS=True, NORM=True)}
    # both FP8 scale paths: per row (bf16's tiles) and uniform (decode_tiles' FP8 tiles)
    for uniform in (False, True) if scaled else (False,):
        tile = dict(BLOCK_N=8, BLOCK_K=2048) if uniform else dict(BLOCK_N=16, BLOCK_K=128)
        for route, sel in routes.items():
            gu = dict(H=2048, INTER=1408, K=6 if route != "v3" else 8, S=2, ROW_DIV=128,
                      SHARED_ROW_DIV=128, HAS_SCALE=scaled, UNIFORM_SCALE=uniform, **tile,
                      CHUNK=1408, **sel)
            sig = signature(D._gate_up_kernel,
                            {**ptrs, **select, "x_ptr": "*bf16", "h_ptr": "*bf16"},
                            floats=("scaling",), constexprs=gu)
            name = f"decode_gate_up_{wt[1:]}_{uniform}_{route}"
            cases.append((name, D._gate_up_kernel, sig, gu))
            # the down kernel selects again before its wait (with ROUTE)
            dn = dict(H=2048, INTER=1408, K=6 if route != "v3" else 8, S=2, HAS_SCALE=scaled,
                      UNIFORM_SCALE=uniform, **tile, CHUNK=1408, TREE=False, **sel)
            sig = signature(D._down_kernel,
                            {**ptrs, **select, "h_ptr": "*bf16", "part_ptr": "*fp32"},
                            floats=("scaling",), constexprs=dn)
            cases.append((f"decode_down_{wt[1:]}_{uniform}_{route}", D._down_kernel, sig, dn))
for name, rl in (
        ("narrow", dict(H=2048, E=64, KB_PER_SPLIT=1, BLOCK_T=16, BLOCK_E=16, BLOCK_K=128)),
        ("small", dict(H=2048, E=64, KB_PER_SPLIT=1, BLOCK_T=16, BLOCK_E=64, BLOCK_K=128)),
        ("small_v3", dict(H=7168, E=256, KB_PER_SPLIT=7, BLOCK_T=16, BLOCK_E=64, BLOCK_K=128)),
        ("prefill", dict(H=2048, E=64, KB_PER_SPLIT=32, BLOCK_T=16, BLOCK_E=64, BLOCK_K=64))):
    sig = signature(R._router_logits_kernel,
                    {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32"}, constexprs=rl)
    cases.append((f"router_logits_{name}", R._router_logits_kernel, sig, rl))
# the sorted (prefill) path's return to token order
sig = signature(C._invert_kernel, {"order_ptr": "*i64", "pos_ptr": "*i32"}, constexprs=("BLOCK",))
cases.append(("sorted_invert", C._invert_kernel, sig, dict(BLOCK=1024)))
for shared in (True, False):
    cb = dict(H=2048, K=6, HAS_SHARED=shared, BLOCK=1024)
    sig = signature(C._combine_kernel, {"rows_ptr": "*bf16", "pos_ptr": "*i32",
                    "weights_ptr": "*fp32", "shared_ptr": "*bf16", "y_ptr": "*bf16"},
                    constexprs=cb)
    cases.append((f"sorted_combine_{shared}", C._combine_kernel, sig, cb))
"""


def test_grouped_moe_kernels_compile_for_sm90_and_sm100() -> None:
    compile_for_gpus(CASES, expected=2 * 44, num_stages=3)
