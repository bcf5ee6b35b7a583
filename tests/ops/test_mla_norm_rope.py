"""Fused latent RMSNorm + RoPE vs `RMSNorm` and `apply_rope`, for both pair layouts. Tolerance:
one bf16 rounding (rtol 1.6e-2, atol 1e-2) on the normed latent; RoPE outputs rtol 1.6e-2,
atol 2e-2 (fp32 products summed in a different order, then one rounding)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.model.layers.norm import RMSNorm
from mlaserve.model.layers.rotary import apply_rope
from tests.ops.cases import GPU_TOKENS, cpu_case, fp8_within_one_step, gpu_case, model_dtype

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


FP8 = torch.float8_e4m3fn
WRITE_CASES = [gpu_case(t, kv) for t in GPU_TOKENS for kv in (FP8, "model")] + [
    cpu_case(3, "model")  # no fp8 under the interpreter (see test_kv_write.py)
]


@pytest.mark.parametrize("num_tokens,kv_dtype,device", WRITE_CASES)
def test_mla_norm_rope_writes_the_cache_like_the_pool(num_tokens, kv_dtype, device, monkeypatch):
    """With `kv_cache`, the kernel stores exactly what `MLAKVPool.write` (torch path) stores for
    the kernel's own normed/roped outputs, at the slots, and nothing else (NaN-poisoned rows).
    Tolerance: bytes equal (fp8: one e4m3 step for < 1% of values, a tie)."""
    from mlaserve.kv_cache.kv_pool import MLAKVPool
    from mlaserve.ops.mla_norm_rope import mla_norm_rope

    heads, rank, nope, rope, page = (16, 512, 128, 64, 64) if device == "cuda" else (2, 16, 8, 8, 4)
    dt = model_dtype(device)
    kv_dtype = dt if kv_dtype == "model" else kv_dtype
    g = torch.Generator(device=device).manual_seed(7 * num_tokens)
    kv = (torch.randn(num_tokens, rank + rope, generator=g, device=device) * 2).to(dt)
    kv_c, k_pe = kv.split([rank, rope], dim=-1)
    q = (torch.randn(num_tokens, heads, nope + rope, generator=g, device=device) * 2).to(dt)
    q_pe = q[..., nope:]
    angles = torch.rand(num_tokens, rope // 2, generator=g, device=device) * 6.3
    cos, sin = angles.cos(), angles.sin()
    weight = (torch.randn(rank, generator=g, device=device) * 0.3 + 1).to(dt)
    scale = 0.05  # pushes some values past e4m3's 448: the saturation is exercised

    monkeypatch.setenv("MLASERVE_FUSED_OPS", "0")
    pages = 2 * num_tokens // page + 3
    pools = [MLAKVPool(1, pages, page, rank, rope, kv_dtype, device, k_scale=scale) for _ in "ab"]
    for pool in pools:
        pool.kv_buffers[0].view(torch.uint8).fill_(0xFF)  # NaN
    slots = torch.randperm(pages * page - 1, generator=g, device=device)[:num_tokens] + 1
    want_c, want_k, want_q = mla_norm_rope(kv_c, k_pe, q_pe, weight, 1e-6, cos, sin, True)
    pools[1].write(0, slots, want_c, want_k)
    none_c, none_k, got_q = mla_norm_rope(
        kv_c, k_pe, q_pe, weight, 1e-6, cos, sin, True, pools[0].kv_buffers[0], slots, scale
    )
    assert none_c is None and none_k is None
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=0)
    got, want = (p.kv_buffers[0].view(-1, rank + rope) for p in pools)
    written = torch.zeros(got.shape[0], dtype=torch.bool, device=device)
    written[slots] = True
    assert got[~written].float().isnan().all(), "a row that was not written changed"
    if kv_dtype == FP8:
        fp8_within_one_step(got[slots], want[slots])
    else:
        torch.testing.assert_close(got[slots], want[slots], rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens,interleaved,device", CASES)
def test_q_pe_roped_in_place_inside_the_query_rows(num_tokens, interleaved, device):
    """`q_pe_out=q_pe`: the roped q_pe lands in q's own rows (a strided view of wider
    projection rows, as the prefill's MHA query uses it), with the bits of the returned tensor;
    q_nope and the rows' other columns are untouched."""
    from mlaserve.ops.mla_norm_rope import mla_norm_rope

    heads, rank, nope, rope = (16, 512, 128, 64) if device == "cuda" else (3, 16, 8, 8)
    g = torch.Generator(device=device).manual_seed(num_tokens + 5)
    dt = model_dtype(device)
    width = heads * (nope + rope) + rank + rope  # [q | kv_c | k_pe] of one fused projection
    rows = torch.randn(num_tokens, width, generator=g, device=device).to(dt)
    q = rows[:, : heads * (nope + rope)].view(num_tokens, heads, nope + rope)
    kv_c, k_pe = rows[:, heads * (nope + rope) :].split([rank, rope], dim=-1)
    q_pe = q[..., nope:]
    angles = torch.rand(num_tokens, rope // 2, generator=g, device=device) * 6.3
    cos, sin = angles.cos(), angles.sin()
    weight = (torch.randn(rank, generator=g, device=device) * 0.3 + 1).to(dt)
    before = rows.clone()
    want_c, want_k, want_q = mla_norm_rope(kv_c, k_pe, q_pe, weight, 1e-6, cos, sin, interleaved)
    got_c, got_k, got_q = mla_norm_rope(
        kv_c, k_pe, q_pe, weight, 1e-6, cos, sin, interleaved, q_pe_out=q_pe
    )
    assert got_q.data_ptr() == q_pe.data_ptr()
    torch.testing.assert_close(q[..., nope:], want_q, rtol=0, atol=0)
    torch.testing.assert_close(got_c, want_c, rtol=0, atol=0)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
    changed = rows != before
    changed_q = changed[:, : heads * (nope + rope)].view(num_tokens, heads, nope + rope)
    assert not changed_q[..., :nope].any() and not changed[:, heads * (nope + rope) :].any()
    with pytest.raises(ValueError, match="q_pe_out"):
        mla_norm_rope(kv_c, k_pe, q_pe, weight, 1e-6, cos, sin, interleaved, q_pe_out=q_pe.float())


def test_warm_up_tasks_one_per_variant(monkeypatch):
    """`mla_norm_rope_warm_up_tasks`: the MHA prefill's variant (q_pe roped in place inside q's
    rows, no cache) and one KV-writing variant per cache dtype, each one call on rows laid out
    with the given strides. Calls recorded, not run (CPU)."""
    from mlaserve.ops import mla_norm_rope as module

    ran = []

    def record(kv_c, k_pe, q_pe, weight, eps, cos, sin, inter, kv_cache=None, slots=None,
               scale=1.0, q_pe_out=None):  # fmt: skip
        in_place = q_pe_out is not None and q_pe_out.data_ptr() == q_pe.data_ptr()
        cache = None if kv_cache is None else kv_cache.dtype
        ran.append((kv_c.shape[0], kv_c.stride(0), q_pe.stride()[:2], cache, in_place))

    monkeypatch.setattr(module, "mla_norm_rope", record)
    heads, nope, rope, rank = 2, 16, 8, 32
    q_strides, kv_stride = (heads * (nope + rope) + 40, nope + rope), rank + rope + 40
    dtypes = (torch.bfloat16, torch.float8_e4m3fn)
    tasks = module.mla_norm_rope_warm_up_tasks(
        q_strides, kv_stride, (nope, rope, rank), heads, torch.ones(rank), False,
        torch.bfloat16, dtypes, 16,
    )  # fmt: skip
    for task in tasks:
        task()
    assert ran == [(16, kv_stride, q_strides, d, d is None) for d in (None, *dtypes)]
