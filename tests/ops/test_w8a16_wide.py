"""The W8A16 block-FP8 GEMM's decode kernel (`fp8_triton._w8a16_wide_kernel`, M <= 16) vs the
float64 product of the same operands: V3's one-rank shapes at TP 1-4 (q|kv_a, q_b, o_proj, the
dense MLP) at M = 2..16 on the GPU, and small ragged shapes (partial N tiles and K blocks, a K
step past the last block) with block and per-row scales under the interpreter.

Everything past the operands is NaN (test_gemv.py's `_operands`): x, w and the scale are the
leading rows of NaN-filled buffers, so a read past K, past the scale's columns or past the last
row turns outputs NaN.

Tolerance: test_gemv.py's (one output rounding plus fp32 accumulation in another order).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu, gpu_case
from tests.ops.test_gemv import _check_close, _operands

# name: (N, K), one rank's FP8 weight
SHAPES = {
    "v3_q_kv_a": (2112, 7168),
    "v3_tp2_q_b": (12288, 1536),
    "v3_tp2_o": (7168, 8192),
    "v3_tp4_o": (7168, 4096),
    "v3_tp2_dense_gate_up": (18432, 7168),
    "v3_tp2_dense_down": (7168, 9216),  # 72 K blocks: the last step of 4 is 0 blocks past K
    "ragged": (1000, 1400),  # a partial N tile and a partial K block at serving size
}
GPU_CASES = [
    gpu_case(m, shape, weights)
    for m in (2, 3, 8, 16)
    for shape in SHAPES
    for weights in ("fp8_block", "fp8_row")
]
# (M, N, K, weights): few programs, the interpreter runs them one by one
CPU_CASES = [
    cpu_case(1, 40, 300, "fp8_block"),  # a partial K block, one step of SUB blocks
    cpu_case(5, 72, 700, "fp8_row"),
    cpu_case(16, 33, 1100, "fp8_block"),  # N one past a tile; 9 K blocks: 3 steps, the last short
    cpu_case(3, 300, 1024, "fp8_block"),  # 10 programs: SUB = 4
]


def _run(m, n, k, weights, device):
    from mlaserve.ops.fp8_triton import W8A16_WIDE_MAX_M, w8a16_block_fp8_matmul_triton
    from mlaserve.ops.gemv import gemv_reference

    assert m <= W8A16_WIDE_MAX_M
    x, w, scale = _operands(m, n, k, weights, device, seed=m * 7 + n + k)
    got = w8a16_block_fp8_matmul_triton(x, w, scale)
    assert got.shape == (m, n) and got.dtype == x.dtype
    _check_close(got, gemv_reference(x, w, scale), x.dtype)
    return x, w, scale, got


@pytest.mark.parametrize("m,shape,weights,device", GPU_CASES)
def test_w8a16_wide_matches_reference(m, shape, weights, device):
    from mlaserve.ops.fp8_triton import w8a16_block_fp8_matmul_triton

    n, k = SHAPES[shape]
    x, w, scale, got = _run(m, n, k, weights, device)
    assert torch.equal(w8a16_block_fp8_matmul_triton(x, w, scale), got)  # no atomics


@pytest.mark.parametrize("m,n,k,weights,device", CPU_CASES)
def test_w8a16_wide_interpreted(m, n, k, weights, device):
    _run(m, n, k, weights, device)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu, id="cuda")])
def test_w8a16_rows_do_not_depend_on_the_batch(device):
    """A row's output is the same whatever the other rows (the MMA's rows are independent and
    every M up to 16 runs the same tile): a decode step's tokens do not change each other."""
    from mlaserve.ops.fp8_triton import w8a16_block_fp8_matmul_triton

    x, w, scale = _operands(16, 7168, 8192, "fp8_block", device, seed=5)
    full = w8a16_block_fp8_matmul_triton(x, w, scale)
    for m in (2, 5, 9):
        assert torch.equal(w8a16_block_fp8_matmul_triton(x[:m], w, scale), full[:m])
