"""The Triton FP8 kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1): tiny shapes
with partial K and N blocks, per-row scales, empty experts. Skipped where Triton is not
installed (`pip install triton` gives it to a CPU machine) and on CUDA machines, where
test_fp8_kernels.py runs the compiled kernels.

The interpreter's float32 -> e4m3 conversion is not the hardware's (it rounds 124.3 to 64), so
the quantisation kernel's codes are checked on the GPU only; here its scales are, and the GEMMs
are fed torch-quantised operands.
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA machine: the compiled kernels are tested instead", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, at import
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _runtime_loop_probe(out_ptr, n):
    acc = 0.0
    for _ in range(0, n):
        acc += 1.0
    tl.store(out_ptr, acc)


def _interpreter_runs_runtime_loops() -> bool:
    """Triton 3.6's interpreter with numpy >= 2.4 cannot run a loop with a runtime bound
    (int() of a 1-element array, an error since numpy 2.4); Triton 3.9's can."""
    out = torch.zeros(1)
    try:
        _runtime_loop_probe[(1,)](out, 3)
    except Exception:  # triton.runtime.errors.InterpreterError
        return False
    return out.item() == 3.0


if not _interpreter_runs_runtime_loops():
    import numpy

    pytest.skip(
        f"Triton {triton.__version__}'s interpreter cannot run runtime loop bounds with numpy "
        f"{numpy.__version__} (works with Triton 3.9)",
        allow_module_level=True,
    )

from mlaserve.ops.fp8_gemm import block_fp8_matmul_reference  # noqa: E402
from mlaserve.ops.fp8_grouped_gemm import align_blocks  # noqa: E402
from mlaserve.ops.fp8_quant import (  # noqa: E402
    dequantize_weight_block,
    expand_scale_rows,
    per_token_group_quant_fp8_torch,
    quantize_weight_block,
)
from mlaserve.ops.fp8_triton import (  # noqa: E402
    grouped_block_fp8_matmul_triton,
    per_token_group_quant_fp8_triton,
    w8a8_block_fp8_matmul_triton,
)
from mlaserve.ops.w8a16_gemm import w8a16_block_fp8_matmul_triton  # noqa: E402

MAX_REL = 1e-5  # fp32 accumulation and fp32 output vs float64: rounding only


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def test_quant_kernel_scales() -> None:
    x = torch.randn(3, 200) * torch.tensor([1.0, 100.0, 0.01])[:, None]
    _, s = per_token_group_quant_fp8_triton(x)
    _, s_ref = per_token_group_quant_fp8_torch(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    _, s_col = per_token_group_quant_fp8_triton(x, column_major_scales=True)
    assert s_col.stride() == (1, 3) and torch.equal(s_col, s)


@pytest.mark.parametrize(("k", "split_k"), [(200, None), (200, 1), (700, 4), (700, 6)])
@pytest.mark.parametrize("per_row", [False, True])
def test_dense_gemm(k: int, split_k: int | None, per_row: bool) -> None:
    """K 700 = 5 full blocks + a partial one; split 4 -> 3 programs of 2 blocks, 6 -> 6 of 1."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, k, generator=g), torch.randn(72, k, generator=g)
    x_q, x_s = per_token_group_quant_fp8_torch(x)
    q, s = quantize_weight_block(w)
    s_used = expand_scale_rows(s, 72) if per_row else s
    y = w8a8_block_fp8_matmul_triton(x_q, x_s, q, s_used, out_dtype=torch.float32, split_k=split_k)
    assert rel(y, block_fp8_matmul_reference(x_q, x_s, q, s)) < MAX_REL


def test_grouped_gemm() -> None:
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 6, 0, 2], dtype=torch.int32)
    x, w = torch.randn(11, 200, generator=g), torch.randn(5, 40, 200, generator=g)
    x_q, x_s = per_token_group_quant_fp8_torch(x)
    q, s = quantize_weight_block(w)
    rows, experts = align_blocks(counts, 11, 16)
    y = grouped_block_fp8_matmul_triton(x_q, x_s, q, s, rows, experts, 16, torch.float32)
    for e, (lo, hi) in enumerate([(0, 3), (3, 3), (3, 9), (9, 9), (9, 11)]):
        if hi > lo:
            ref = block_fp8_matmul_reference(x_q[lo:hi], x_s[lo:hi], q[e], s[e])
            assert rel(y[lo:hi], ref) < MAX_REL, e


@pytest.mark.parametrize("per_row", [False, True])
def test_dense_w8a16_gemm(per_row: bool) -> None:
    """K 700 (a partial last block), N 72 (a partial N tile): unquantised rows times W."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 700, generator=g), torch.randn(72, 700, generator=g)
    q, s = quantize_weight_block(w)
    s_used = expand_scale_rows(s, 72) if per_row else s
    y = w8a16_block_fp8_matmul_triton(x, q, s_used)
    ref = x.double() @ dequantize_weight_block(q, s, torch.float64).t()
    assert rel(y, ref) < MAX_REL


def test_grouped_w8a16_gemm() -> None:
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([3, 0, 6, 0, 2], dtype=torch.int32)
    x, w = torch.randn(11, 200, generator=g), torch.randn(5, 40, 200, generator=g)
    q, s = quantize_weight_block(w)
    rows, experts = align_blocks(counts, 11, 16)
    y = grouped_block_fp8_matmul_triton(x, None, q, s, rows, experts, 16, torch.float32)
    for e, (lo, hi) in enumerate([(0, 3), (3, 3), (3, 9), (9, 9), (9, 11)]):
        if hi > lo:
            ref = x[lo:hi].double() @ dequantize_weight_block(q[e], s[e], torch.float64).t()
            assert rel(y[lo:hi], ref) < MAX_REL, e
