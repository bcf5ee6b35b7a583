"""The W8A16 block-FP8 GEMM's decode kernel (`w8a16_gemm._w8a16_wide_kernel`, M <= 16) vs the
float64 product of the same operands: V3's one-rank shapes at TP 1-4 (q|kv_a, q_b, o_proj, the
dense MLP) at M = 2..16 on the GPU, and small ragged shapes (partial N tiles and K blocks, a K
step past the last block) with block and per-row scales under the interpreter. Its K split
(`w8a16_wide_split`; V3's q|kv_a takes it by the rule): forced splits against the same
reference, the same bits call after call, and the arrival counters back at zero.

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
    "v3_tp8_dense_gate_up": (4608, 7168),  # split 4 by the rule, as q|kv_a
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
# (M, N, K, weights, split): split kernels under the interpreter
CPU_SPLIT_CASES = [
    cpu_case(3, 40, 1024, "fp8_block", 2),  # 8 blocks: two splits of 4, two steps each
    cpu_case(5, 72, 1536, "fp8_row", 3),  # 4 blocks a split: two steps of SUB = 2
    cpu_case(2, 33, 1100, "fp8_block", 3),  # 9 blocks, the last partial: 3 a split, a short step
]


def _run(m, n, k, weights, device):
    from mlaserve.ops.gemv import gemv_reference
    from mlaserve.ops.w8a16_gemm import W8A16_WIDE_MAX_M, w8a16_block_fp8_matmul_triton

    assert m <= W8A16_WIDE_MAX_M
    x, w, scale = _operands(m, n, k, weights, device, seed=m * 7 + n + k)
    got = w8a16_block_fp8_matmul_triton(x, w, scale)
    assert got.shape == (m, n) and got.dtype == x.dtype
    _check_close(got, gemv_reference(x, w, scale), x.dtype)
    return x, w, scale, got


@pytest.mark.parametrize("m,shape,weights,device", GPU_CASES)
def test_w8a16_wide_matches_reference(m, shape, weights, device):
    from mlaserve.ops.w8a16_gemm import w8a16_block_fp8_matmul_triton

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
    from mlaserve.ops.w8a16_gemm import w8a16_block_fp8_matmul_triton

    x, w, scale = _operands(16, 7168, 8192, "fp8_block", device, seed=5)
    full = w8a16_block_fp8_matmul_triton(x, w, scale)
    for m in (2, 5, 9):
        assert torch.equal(w8a16_block_fp8_matmul_triton(x[:m], w, scale), full[:m])


def _counters_zero(device) -> None:
    from mlaserve.ops.split_counters import split_counters

    assert not split_counters(torch.device(device), 1).any()  # each tile's last split reset it


@pytest.mark.parametrize("m,n,k,weights,split,device", CPU_SPLIT_CASES)
def test_w8a16_wide_split_interpreted(m, n, k, weights, split, device):
    from mlaserve.ops.gemv import gemv_reference
    from mlaserve.ops.w8a16_gemm import w8a16_block_fp8_matmul_triton

    x, w, scale = _operands(m, n, k, weights, device, seed=m + n + k)
    got = w8a16_block_fp8_matmul_triton(x, w, scale, split=split)
    _check_close(got, gemv_reference(x, w, scale), x.dtype)
    _counters_zero(device)


@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize("split", [2, 4, 7, 8])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu, id="cuda")])
def test_w8a16_wide_split_matches_reference(m, split, device):
    """V3's q|kv_a (56 K blocks) split 2-8 ways: 7 and 8 leave a short last step of SUB."""
    from mlaserve.ops.gemv import gemv_reference
    from mlaserve.ops.w8a16_gemm import w8a16_block_fp8_matmul_triton

    n, k = SHAPES["v3_q_kv_a"]
    x, w, scale = _operands(m, n, k, "fp8_block", device, seed=split * 3 + m)
    got = w8a16_block_fp8_matmul_triton(x, w, scale, split=split)
    _check_close(got, gemv_reference(x, w, scale), x.dtype)
    for _ in range(3):  # the last arrival sums in split order: the same bits every call
        assert torch.equal(w8a16_block_fp8_matmul_triton(x, w, scale, split=split), got)
    _counters_zero(device)


def test_w8a16_wide_split_rule():
    """Split where the weight's 32-row tiles leave SMs idle and K is long (V3's q|kv_a and a
    TP8 rank's dense gate_up on an H100 / H200's 132 SMs and a B200's 148), never where the
    tiles fill the GPU or K is short, always a divisor of K's blocks."""
    from mlaserve.ops.w8a16_gemm import w8a16_wide_split

    assert w8a16_wide_split(2112, 7168, 132) == 4  # V3 / K2 q|kv_a: 66 tiles
    assert w8a16_wide_split(2112, 7168, 148) == 4
    assert w8a16_wide_split(4608, 7168, 132) == 4  # TP8 dense gate_up: 144 tiles
    assert w8a16_wide_split(7168, 14336, 132) == 1  # the MTP eh_proj: 224 tiles
    assert w8a16_wide_split(7168, 4096, 132) == 1  # TP4 o_proj
    assert w8a16_wide_split(3072, 1536, 132) == 1  # TP8 q_b: splits of 768 keys
    assert w8a16_wide_split(3072, 2048, 132) == 1  # V2-Lite q: split in two ran slower
    assert w8a16_wide_split(64, 1100, 132) == 1  # K off the 128 grid
    for n in (32, 576, 2112, 4000):
        for k in (1536, 3072, 7168, 9216):
            split = w8a16_wide_split(n, k, 132)
            assert 1 <= split <= 4 and (k // 128) % split == 0
            assert split == 1 or k // split >= 1536


def test_w8a16_wide_split_refuses_a_split_off_the_blocks():
    from mlaserve.ops.w8a16_gemm import w8a16_block_fp8_matmul_triton

    x = torch.zeros(2, 1024)
    w = torch.zeros(64, 1024, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="split 3 does not divide K 1024's 8"):
        w8a16_block_fp8_matmul_triton(x, w, torch.ones(1, 8), split=3)
