"""The deterministic mode's summation-tree kernels compile for SM90 (H100) and SM100 (B200)
without either GPU: the invariant matmul at 1, 2 and 8 leaves (bf16, FP8 block, fp32 operands;
the leaves settled behind `invariant_tree.settled`'s inline PTX), `moe_decode`'s gate_up and
down kernels with leaves (S = 2 shared slices moved into runs, bf16 per-row and FP8 uniform
scales) and the partials' combine over 8 leaves. What the interpreter lets through but the
compiler refuses (two returns of different integer types, an inline-asm constraint) fails here.
"""

from __future__ import annotations

import pytest

from tests.aot_compile import compile_for_gpus

pytest.importorskip("triton")

CASES = r"""
from mlaserve.ops import invariant_matmul as I
from mlaserve.ops import moe_decode as D
from mlaserve.ops import moe_partials_combine as P

for wt, x, fp32, scaled in (("*bf16", "*bf16", False, False), ("*fp8e4nv", "*bf16", False, True),
                            ("*fp32", "*bf16", True, False)):
    for leaves in (1, 2, 8):
        block = (64, 64, 32) if fp32 else (64, 64, 128)
        mm = dict(N=2048, K=2048, HAS_SCALE=scaled, ROW_DIV=128, HAS_BIAS=False, FP32=fp32,
                  BLOCK_M=block[0], BLOCK_N=block[1], BLOCK_K=block[2], LEAVES=leaves,
                  BARRIER=True)
        sig = signature(I._invariant_matmul_kernel,
                        {"x_ptr": x, "w_ptr": wt, "s_ptr": "*fp32", "b_ptr": wt, "y_ptr": "*fp32"},
                        constexprs=mm)
        cases.append((f"matmul_{wt[1:]}_{leaves}", I._invariant_matmul_kernel, sig, mm))
sel = dict(SPLITS=1, G=1, PG=64, TOPK_GROUP=1, BLOCK_G=1, BLOCK_PG=64, BLOCK_K_SEL=8, METHOD=0,
           SIGMOID=False, HAS_BIAS=False, NORM=False, ROUTE=False, PDL=True)
# (weights, inter, chunk, gate_up tile, down tile, uniform): V2-Lite's 1408 in 8 leaves of 176
# (bf16); a V3 TP2 rank's 1024 in 4 leaves of 256 (FP8 block scales)
for wt, inter, chunk, gu_tile, dn_tile, uniform in (
        ("*bf16", 1408, 176, (16, 128), (16, 128), False),
        ("*fp8e4nv", 1024, 256, (8, 2048), (8, 256), True)):
    ptrs = {"ids_ptr": "*i64", "w_ptr": wt, "sw_ptr": wt, "s_ptr": "*fp32", "ss_ptr": "*fp32",
            "wts_ptr": "*fp32", "logits_ptr": "*fp32", "bias_ptr": "*fp32"}
    common = dict(H=2048, INTER=inter, K=6, S=2, HAS_SCALE=uniform, UNIFORM_SCALE=uniform,
                  CHUNK=chunk, **sel)
    gu = dict(common, ROW_DIV=128, SHARED_ROW_DIV=128, BLOCK_N=gu_tile[0], BLOCK_K=gu_tile[1])
    sig = signature(D._gate_up_kernel, {**ptrs, "x_ptr": "*bf16", "h_ptr": "*bf16"},
                    floats=("scaling",), constexprs=gu)
    cases.append((f"decode_gate_up_tree_{wt[1:]}", D._gate_up_kernel, sig, gu))
    dn = dict(common, BLOCK_N=dn_tile[0], BLOCK_K=dn_tile[1], TREE=True)
    sig = signature(D._down_kernel, {**ptrs, "h_ptr": "*bf16", "part_ptr": "*fp32"},
                    floats=("scaling",), constexprs=dn)
    cases.append((f"decode_down_tree_{wt[1:]}", D._down_kernel, sig, dn))
cb = dict(H=2048, SLOTS=8, LEAVES=8, BLOCK=1024, PDL=True)
sig = signature(P._combine_kernel, {"part_ptr": "*fp32", "y_ptr": "*fp32"}, constexprs=cb)
cases.append(("partials_combine_8_leaves", P._combine_kernel, sig, cb))
"""


def test_tree_kernels_compile_for_sm90_and_sm100() -> None:
    compile_for_gpus(CASES, expected=2 * 14, num_stages=3)
