"""The Triton FP8 kernels compile for SM90 (H100) and SM100 (B200) without either GPU.

Triton's own ahead-of-time path (`triton.compile` with a `GPUTarget`) lowers each kernel to a
cubin with the ptxas Triton ships, so a kernel that the H100 or a B200 would refuse (an fp8
`tl.dot` shape, a type error, a dynamic loop bound) fails here, on a CPU machine. It runs in a
subprocess: the interpreter tests set TRITON_INTERPRET, which must not leak into this import.
Skipped where Triton is not installed.
"""

from __future__ import annotations

import pytest

from tests.aot_compile import compile_for_gpus, ptx_for_sm90

pytest.importorskip("triton")

CASES = r"""
from mlaserve.ops import fp8_triton as K
from mlaserve.ops import w8a16_gemm as W

fp8 = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "as_ptr": "*fp32", "bs_ptr": "*fp32"}
tiles = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
w8a16 = {"a_ptr": "*bf16", "as_ptr": "*bf16"}  # bf16 activations; as_ptr unused
for bm, bn, out, a_fp8 in ((16, 64, "*bf16", True), (16, 64, "*fp32", True),
                           (64, 128, "*bf16", True), (32, 16, "*bf16", False),
                           (64, 64, "*bf16", False)):
    ptrs = {**fp8, "c_ptr": out, **({} if a_fp8 else w8a16)}
    sig = signature(K._block_fp8_matmul_kernel, ptrs, constexprs=(*tiles, "GROUP_M", "A_FP8"))
    cases.append((f"dense_{bm}x{bn}_{out[1:]}_{'w8a8' if a_fp8 else 'w8a16'}",
                  K._block_fp8_matmul_kernel, sig,
                  {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 8, "A_FP8": a_fp8}))
for bm, bn, a_fp8 in ((16, 64, True), (64, 128, True), (16, 64, False)):
    ptrs = {**fp8, "c_ptr": "*bf16", "sorted_rows_ptr": "*i32", "block_expert_ptr": "*i32",
            **({} if a_fp8 else w8a16)}
    sig = signature(K._grouped_block_fp8_matmul_kernel, ptrs, constexprs=(*tiles, "A_FP8"))
    cases.append((f"grouped_{bm}x{bn}_{'w8a8' if a_fp8 else 'w8a16'}",
                  K._grouped_block_fp8_matmul_kernel, sig,
                  {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "A_FP8": a_fp8}))
wide = ("K", "BLOCK_M", "BLOCK_N", "SUB", "SPLIT", "KB_PER")
for out, sub, split in (("*bf16", 4, 1), ("*bf16", 2, 1), ("*fp32", 4, 1), ("*bf16", 2, 4),
                        ("*fp32", 2, 4), ("*bf16", 4, 4)):  # 14 blocks a split, 4 a step
    sig = signature(W._w8a16_wide_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                    "y_ptr": out, "ws_ptr": "*fp32", "cnt_ptr": "*i32"}, constexprs=wide)
    cases.append((f"w8a16_wide_sub{sub}_split{split}_{out[1:]}", W._w8a16_wide_kernel, sig,
                  {"K": 7168, "BLOCK_M": 16, "BLOCK_N": 32, "SUB": sub, "SPLIT": split,
                   "KB_PER": 56 // split}))
sig = signature(K._per_token_group_quant_kernel,
                {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                floats=("fp8_max", "eps"), constexprs=("GROUP",))
cases.append(("quant", K._per_token_group_quant_kernel, sig, {"GROUP": 128}))
"""


def test_kernels_compile_for_sm90_and_sm100() -> None:
    compile_for_gpus(CASES, expected=2 * 15, num_stages=4)


WIDEN_CASES = r"""
from mlaserve.ops import fp8_triton as K
from mlaserve.ops import w8a16_gemm as W

for act in ("bf16", "fp16"):
    sig = signature(W._w8a16_wide_kernel, {"x_ptr": f"*{act}", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                    "y_ptr": f"*{act}", "ws_ptr": "*fp32", "cnt_ptr": "*i32"},
                    constexprs=("K", "BLOCK_M", "BLOCK_N", "SUB", "SPLIT", "KB_PER"))
    cases.append((f"wide_{act}", W._w8a16_wide_kernel, sig,
                  {"K": 7168, "BLOCK_M": 16, "BLOCK_N": 32, "SUB": 4, "SPLIT": 1, "KB_PER": 56}))
    sig = signature(K._block_fp8_matmul_kernel, {"a_ptr": f"*{act}", "b_ptr": "*fp8e4nv",
                    "as_ptr": f"*{act}", "bs_ptr": "*fp32", "c_ptr": f"*{act}"},
                    constexprs=("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "A_FP8"))
    cases.append((f"dense_{act}", K._block_fp8_matmul_kernel, sig,
                  {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "A_FP8": False}))
"""


def test_w8a16_widens_the_weight_to_bf16_through_fp32() -> None:
    """e4m3 -> bf16 goes e4m3 -> f16 -> f32 -> bf16 (`widen_e4m3`): packed f32 -> bf16 converts,
    not the scalar f16 -> bf16 pair Triton emits for the direct cast, which made these kernels
    slower. To fp16 the weight takes the one packed e4m3 -> f16 convert."""
    ptx = ptx_for_sm90(WIDEN_CASES)
    for name in ("wide_bf16", "dense_bf16"):
        assert "cvt.rn.bf16x2.f32" in ptx[name], name
        assert "cvt.bf16.f16" not in ptx[name], name
    for name in ("wide_fp16", "dense_fp16"):
        assert "cvt.rn.f16x2.e4m3x2" in ptx[name], name
        assert "cvt.f32.f16" not in ptx[name] and "bf16" not in ptx[name], name
