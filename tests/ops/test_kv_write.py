"""Fused KV write vs `MLAKVPool`'s torch path: same bytes at the written slots, every other row
untouched (NaN-poisoned). Tolerance: bf16/fp16 exact; fp8 exact, or one e4m3 step for < 1% of
values (a tie rounded the other way)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.kv_cache.kv_pool import MLAKVPool
from tests.ops.cases import GPU_TOKENS, cpu_case, fp8_within_one_step, gpu_case

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
CASES = [gpu_case(t, kv, s) for t in GPU_TOKENS for kv in (FP8, BF16) for s in (1.0, 0.37)] + [
    # fp8 only on the GPU: Triton 3.6's interpreter casts to e4m3 wrongly when rounding carries
    # into the exponent (31.0 -> 16.0, 124.0 -> 64.0), so its fp8 bytes prove nothing.
    cpu_case(3, BF16, 1.0),
    cpu_case(2, torch.float16, 0.37),
]


def _pool(num_tokens: int, kv_dtype: torch.dtype, scale: float, device: str) -> MLAKVPool:
    rank, rope = (512, 64) if device == "cuda" else (16, 8)
    page = 64 if device == "cuda" else 4
    pages = 2 * num_tokens // page + 3
    pool = MLAKVPool(2, pages, page, rank, rope, kv_dtype, device, k_scale=[1.0, scale])
    for buf in pool.kv_buffers:
        buf.view(torch.uint8).fill_(0xFF)  # all-ones bytes: NaN in e4m3, bf16 and fp16
    return pool


@pytest.mark.parametrize("num_tokens,kv_dtype,scale,device", CASES)
def test_write_matches_reference(num_tokens, kv_dtype, scale, device, monkeypatch):
    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    fused = _pool(num_tokens, kv_dtype, scale, device)
    assert fused._fused_write is not None
    monkeypatch.setenv("MLASERVE_FUSED_OPS", "0")
    ref = _pool(num_tokens, kv_dtype, scale, device)
    assert ref._fused_write is None

    g = torch.Generator(device=device).manual_seed(num_tokens)
    total_slots = fused.num_pages * fused.page_size
    # Distinct slots, none in page 0's first row (kept NaN to check it stays untouched).
    slots = torch.randperm(total_slots - 1, generator=g, device=device)[:num_tokens] + 1
    # A [T, r + d_r] projection output split into views, as the model hands them over; values
    # up to ~1000 so the fp8 path saturates at the small scale.
    kv = torch.randn(num_tokens, fused.dim, generator=g, device=device) * 200
    kv = kv.to(torch.bfloat16 if kv_dtype != torch.float16 else torch.float16)
    kv_c, k_pe = kv.split([fused.kv_lora_rank, fused.qk_rope_head_dim], dim=-1)
    for layer in (0, 1):
        fused.write(layer, slots, kv_c, k_pe)
        ref.write(layer, slots, kv_c, k_pe)
        got = fused.kv_buffers[layer].view(-1, fused.dim)
        want = ref.kv_buffers[layer].view(-1, fused.dim)
        written = torch.zeros(total_slots, dtype=torch.bool, device=device)
        written[slots] = True
        assert got[~written].float().isnan().all(), "a row that was not written changed"
        if kv_dtype == FP8:
            fp8_within_one_step(got[slots], want[slots])
        else:
            torch.testing.assert_close(got[slots], want[slots], rtol=0, atol=0)
