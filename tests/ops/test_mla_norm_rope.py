"""Fused latent RMSNorm + RoPE vs `RMSNorm` and `apply_rope`, for both pair layouts. Tolerance:
one bf16 rounding (rtol 1.6e-2, atol 1e-2) on the normed latent; RoPE outputs rtol 1.6e-2,
atol 2e-2 (fp32 products summed in a different order, then one rounding)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.model.layers.norm import RMSNorm
from mlaserve.model.layers.rotary import apply_rope
from tests.ops.cases import GPU_TOKENS, cpu_case, gpu_case, model_dtype

CASES = [gpu_case(t, i) for t in GPU_TOKENS for i in (True, False)] + [
    cpu_case(2, True),
    cpu_case(3, False),
]


@pytest.mark.parametrize("num_tokens,interleaved,device", CASES)
def test_mla_norm_rope_matches_reference(num_tokens, interleaved, device, monkeypatch):
    from mlaserve.ops.mla_norm_rope import mla_norm_rope

    heads, rank, nope, rope = (16, 512, 128, 64) if device == "cuda" else (3, 16, 8, 8)
    g = torch.Generator(device=device).manual_seed(num_tokens)
    dt = model_dtype(device)
    # Split views of the projections' outputs, as MLAAttention has them.
    kv = (torch.randn(num_tokens, rank + rope, generator=g, device=device) * 2).to(dt)
    kv_c, k_pe = kv.split([rank, rope], dim=-1)
    q = (torch.randn(num_tokens, heads, nope + rope, generator=g, device=device) * 2).to(dt)
    q_pe = q[..., nope:]
    positions = torch.randint(0, 8192, (num_tokens,), generator=g, device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope, 2, device=device).float() / rope))
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = freqs.cos() * 1.1, freqs.sin() * 1.1  # an attention factor != 1
    monkeypatch.setenv("MLASERVE_FUSED_OPS", "0")
    with torch.device(device):
        norm = RMSNorm(rank, 1e-6, params_dtype=dt)
    norm.weight.normal_(1.0, 0.3, generator=g)

    got_c, got_k, got_q = mla_norm_rope(kv_c, k_pe, q_pe, norm.weight, 1e-6, cos, sin, interleaved)
    torch.testing.assert_close(got_c, norm(kv_c), rtol=1.6e-2, atol=1e-2)
    tol = {"rtol": 1.6e-2, "atol": 2e-2}
    torch.testing.assert_close(got_k, apply_rope(k_pe, cos, sin, interleaved), **tol)
    torch.testing.assert_close(got_q, apply_rope(q_pe, cos, sin, interleaved), **tol)
