"""Fused SiLU-and-mul vs `mlaserve.model.layers.mlp.silu_and_mul`. Tolerance: one bf16 rounding
(rtol 1.6e-2, atol 1e-3; exp differs in the last fp32 bits between torch and Triton)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.model.layers.mlp import silu_and_mul
from tests.ops.cases import GPU_TOKENS, cpu_case, gpu_case, model_dtype

# 1408: V2-Lite's expert / shared intermediate size; 10944 its dense layer's.
CASES = [gpu_case(t, i) for t in GPU_TOKENS for i in (1408, 10944)] + [cpu_case(3, 40)]


@pytest.mark.parametrize("num_tokens,inter,device", CASES)
def test_silu_and_mul_matches_reference(num_tokens, inter, device):
    from mlaserve.ops.silu_and_mul import silu_and_mul as fused

    g = torch.Generator(device=device).manual_seed(inter + num_tokens)
    x = (torch.randn(num_tokens, 2 * inter, generator=g, device=device) * 4).to(model_dtype(device))
    got = fused(x)
    assert got.shape == (num_tokens, inter) and got.is_contiguous()
    torch.testing.assert_close(got, silu_and_mul(x), rtol=1.6e-2, atol=1e-3)
