"""Linear layers take `ops.gemv` for decode-sized inputs (a host decision by shape, so fixed per
captured graph) and the GEMM otherwise, with the same result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mlaserve.ops.gemv as gemv_module
from mlaserve.model.layers.linear import GEMV_MAX_M, ReplicatedLinear, gemv_max_m
from tests.ops.cases import cpu_case, gpu_case, model_dtype


@pytest.mark.parametrize(
    "device", [cpu_case(), gpu_case()], ids=lambda d: d if isinstance(d, str) else ""
)
def test_linear_takes_the_gemv_up_to_its_limit(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    monkeypatch.setenv("MLASERVE_GEMV_MAX_M", "2")
    dtype = model_dtype(torch.device(device))
    with torch.device(device):
        lin = ReplicatedLinear(96, 40, bias=True, params_dtype=dtype)
    assert lin.gemv_max_m == 2
    gen = torch.Generator(device=device).manual_seed(0)
    lin.weight.data.copy_(torch.randn(40, 96, generator=gen, device=device) / 10)
    lin.bias.data.copy_(torch.randn(40, generator=gen, device=device))
    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    for tokens, gemv_calls in ((1, 1), (2, 2), (3, 2)):
        x = torch.randn(tokens, 96, generator=gen, device=device).to(dtype)
        y = lin(x)
        want = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
        assert len(calls) == gemv_calls, tokens


def test_gemv_limit_is_off_without_fused_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLASERVE_FUSED_OPS", "0")
    assert gemv_max_m(torch.empty(2, 2)) == 0
    monkeypatch.setenv("MLASERVE_FUSED_OPS", "")
    assert gemv_max_m(torch.empty(2, 2)) in (0, GEMV_MAX_M)  # 0 on CPU


def test_gemv_limits_follow_the_measured_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    for env in ("MLASERVE_GEMV_MAX_M", "MLASERVE_GEMV_MAX_M_FP8"):
        monkeypatch.delenv(env, raising=False)
    fp8 = torch.float8_e4m3fn
    cases = [
        ((3648, 2048), torch.bfloat16, 2),  # V2-Lite q|kv_a: cuBLAS wins from 4 tokens
        ((3648, 2048), fp8, 2),
        ((2112, 7168), fp8, 2),  # V3 q|kv_a: the W8A16 kernel's 66 programs lose at 2 tokens
        ((24576, 1536), fp8, 1),  # V3 q_b: the W8A16 kernel wins from 2 tokens
        ((576, 7168), torch.bfloat16, 4),  # narrow, long K: V3 kv_a
        ((576, 2048), torch.bfloat16, 8),  # narrow, short K: V2-Lite kv_a
        ((7168, 16384), fp8, 0),  # V3 o_proj: K too long for a GEMV without a K split
    ]
    for shape, dtype, limit in cases:
        assert gemv_max_m(torch.empty(shape, dtype=dtype, device="meta")) == limit, shape
    monkeypatch.setenv("MLASERVE_GEMV_MAX_M_FP8", "0")
    assert gemv_max_m(torch.empty(64, 64, dtype=fp8, device="meta")) == 0
