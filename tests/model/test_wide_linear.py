"""fp32 outputs of the linears (`linear.wide_linear`, `block_fp8_linear(out_dtype=)`): the
accumulator unrounded, so a tensor-parallel rank's partial sum and the LM head's logits are never
rounded to 16 bits first. CPU paths here (and the CUDA GEMM with `-m gpu`); the CUDA GEMMs also
ran in the TP2 runs (bench/RESULTS.md)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.model.layers.linear import RowParallelLinear, wide_linear
from mlaserve.ops.fp8_gemm import block_fp8_linear
from mlaserve.ops.fp8_quant import quantize_weight_block
from tests.ops.cases import gpu


def test_wide_linear_is_the_fp32_product_of_16_bit_operands() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=gen).to(torch.bfloat16)
    w = torch.randn(70, 300, generator=gen).to(torch.bfloat16)
    b = torch.randn(70, generator=gen).to(torch.bfloat16)
    y = wide_linear(x, w, b)
    assert y.dtype == torch.float32 and y.shape == (5, 70)
    want = x.float() @ w.float().t() + b.float()
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-5)
    # the 16-bit GEMM's result is this one rounded (up to fp32 summation order)
    rounded = torch.nn.functional.linear(x, w, b)
    assert ((y.to(torch.bfloat16) != rounded).float().mean()) < 0.02


def test_block_fp8_linear_in_fp32_is_its_16_bit_result_unrounded() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    w_q, w_s = quantize_weight_block(torch.randn(128, 256, generator=gen) / 16)
    wide = block_fp8_linear(x, w_q, w_s, out_dtype=torch.float32, backend="emulated")
    narrow = block_fp8_linear(x, w_q, w_s, backend="emulated")
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
    assert torch.equal(wide.to(torch.bfloat16), narrow)


def test_row_parallel_linear_on_one_rank_keeps_the_model_dtype() -> None:
    """One rank has no partial sum: its output stays in x's dtype, wide switch or not."""
    layer = RowParallelLinear(64, 32, params_dtype=torch.bfloat16, reduce_output=False)
    layer.weight.data.normal_()
    assert layer(torch.randn(2, 64).to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu, id="cuda")])
def test_wide_linear_takes_zero_rows(device: str) -> None:
    """A step with no logit rows (a middle chunk of a long prompt) gives the LM head 0 rows:
    [0, N] fp32 out (on CUDA the fp32-output GEMM's view once could not infer N)."""
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    w = torch.ones(48, 64, dtype=torch.bfloat16, device=device)
    y = wide_linear(x, w)
    assert y.shape == (0, 48) and y.dtype == torch.float32
    assert wide_linear(x.view(0, 1, 64), w).shape == (0, 1, 48)
