"""Fused query preparation vs FlashMLA's unfused glue (cat, clamp, cast). Tolerance: exact for
bf16 (a cast); fp8 exact or one e4m3 step for < 1% of values (GPU only: the interpreter's e4m3
cast is wrong, see test_kv_write.py)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import GPU_TOKENS, cpu_case, fp8_within_one_step, gpu_case

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
CASES = [gpu_case(t, d) for t in GPU_TOKENS for d in (FP8, BF16)] + [cpu_case(3, BF16)]


def _reference(q_nope: torch.Tensor, q_pe: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q = torch.cat([q_nope, q_pe], dim=-1)
    if dtype == FP8:
        q = q.clamp(-448.0, 448.0)
    return q.to(dtype)


@pytest.mark.parametrize("num_tokens,out_dtype,device", CASES)
def test_prepare_q_matches_reference(num_tokens, out_dtype, device):
    from mlaserve.ops.q_prep import prepare_q

    heads, rank, rope = (16, 512, 64) if device == "cuda" else (3, 16, 8)
    g = torch.Generator(device=device).manual_seed(num_tokens)
    # As the model hands them over: q_nope the transposed bmm output ([H, T, r] storage),
    # q_pe a split view of [T, H, d_n + d_r]; values past +-448 to exercise the saturation.
    q_nope = (torch.randn(heads, num_tokens, rank, generator=g, device=device) * 150).to(BF16)
    q_nope = q_nope.transpose(0, 1)
    q = (torch.randn(num_tokens, heads, 2 * rope, generator=g, device=device) * 150).to(BF16)
    q_pe = q[..., rope:]
    got = prepare_q(q_nope, q_pe, out_dtype)
    want = _reference(q_nope, q_pe, out_dtype)
    assert got.shape == (num_tokens, heads, rank + rope) and got.dtype == out_dtype
    if out_dtype == FP8:
        fp8_within_one_step(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
