"""The one-launch decode prologue vs its two kernels run apart (`mla_norm_rope` with the KV write,
then `head_gemv` for W_UK): the same programs, so the same bits (tolerance 0), cache rows
included; rows of the NaN-poisoned cache that no token owns stay NaN."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case, model_dtype

FP8 = torch.float8_e4m3fn
CASES = [gpu_case(t, kv, i) for t in (1, 2, 3, 8) for kv in (FP8, "model") for i in (True, False)]
CASES += [cpu_case(1, "model", True), cpu_case(3, "model", False)]  # no fp8 in the interpreter


def _inputs(num_tokens: int, device: str):
    """Projection rows laid out as the layer has them: [q (H x (d_n + d_r)) | kv_c | k_pe]."""
    heads, nope, rope, rank = (16, 128, 64, 512) if device == "cuda" else (2, 8, 8, 16)
    dt = model_dtype(device)
    g = torch.Generator(device=device).manual_seed(31 * num_tokens)
    width = heads * (nope + rope) + rank + rope
    rows = (torch.randn(num_tokens, width, generator=g, device=device) * 2).to(dt)
    q = rows[:, : heads * (nope + rope)].view(num_tokens, heads, nope + rope)
    kv_c, k_pe = rows[:, heads * (nope + rope) :].split([rank, rope], dim=-1)
    angles = torch.rand(num_tokens, rope // 2, generator=g, device=device) * 6.3
    weight = (torch.randn(rank, generator=g, device=device) * 0.3 + 1).to(dt)
    w_uk = (torch.randn(heads, nope, rank, generator=g, device=device) * nope**-0.5).to(dt)
    return q[..., :nope], q[..., nope:], kv_c, k_pe, angles.cos(), angles.sin(), weight, w_uk


@pytest.mark.parametrize("num_tokens,kv_dtype,interleaved,device", CASES)
def test_prologue_matches_its_two_kernels(num_tokens, kv_dtype, interleaved, device):
    from mlaserve.ops.head_gemv import head_gemv
    from mlaserve.ops.mla_decode_prologue import mla_decode_prologue
    from mlaserve.ops.mla_norm_rope import mla_norm_rope

    q_nope, q_pe, kv_c, k_pe, cos, sin, weight, w_uk = _inputs(num_tokens, device)
    kv_dtype = model_dtype(device) if kv_dtype == "model" else kv_dtype
    page, width = 4, kv_c.shape[1] + k_pe.shape[1]
    caches = [torch.empty(num_tokens + 3, page, width, dtype=kv_dtype, device=device) for _ in "ab"]
    for c in caches:
        c.view(torch.uint8).fill_(0xFF)  # NaN in every cache dtype
    g = torch.Generator(device=device).manual_seed(num_tokens)
    slots = torch.randperm(caches[0].shape[0] * page, generator=g, device=device)[:num_tokens]
    scale = 0.05  # pushes fp8 values past 448: the saturation is exercised
    common = (weight, 1e-6, cos, sin, interleaved)

    _, _, want_q_pe = mla_norm_rope(kv_c, k_pe, q_pe, *common, caches[0], slots, scale)
    want_latent = head_gemv(q_nope, w_uk)
    got_latent, got_q_pe = mla_decode_prologue(
        kv_c, k_pe, q_nope, q_pe, *common, w_uk, caches[1], slots, scale
    )

    torch.testing.assert_close(got_latent, want_latent, rtol=0, atol=0)
    torch.testing.assert_close(got_q_pe, want_q_pe, rtol=0, atol=0)
    want, got = (c.view(-1, width) for c in caches)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "cache bytes differ"
    untouched = torch.ones(got.shape[0], dtype=torch.bool, device=device)
    untouched[slots] = False
    assert got[untouched].float().isnan().all(), "a row no token owns was written"
    assert not got[slots].float().isnan().any()


JOINED_CASES = [
    gpu_case(t, kv, i) for t in (1, 3, 8) for kv in (FP8, "model") for i in (True, False)
]
JOINED_CASES += [cpu_case(2, "model", True), cpu_case(3, "model", False)]


@pytest.mark.parametrize("num_tokens,dtype,interleaved,device", JOINED_CASES)
def test_joined_query_matches_its_two_kernels(num_tokens, dtype, interleaved, device):
    """`joined=`: FlashMLA's query [q_nope @ W_UK | rope(q_pe)] (e4m3 for an fp8 cache, else the
    model's dtype), q_pe roped by the GEMV's own programs: the bits of `mla_norm_rope` then
    `head_gemv(tail=...)`, the cache rows too."""
    from mlaserve.ops.head_gemv import head_gemv
    from mlaserve.ops.mla_decode_prologue import mla_decode_prologue
    from mlaserve.ops.mla_norm_rope import mla_norm_rope

    q_nope, q_pe, kv_c, k_pe, cos, sin, weight, w_uk = _inputs(num_tokens, device)
    dtype = model_dtype(device) if dtype == "model" else dtype
    heads, rank, rope = w_uk.shape[0], w_uk.shape[2], q_pe.shape[2]
    caches = [torch.zeros(num_tokens, 1, rank + rope, dtype=dtype, device=device) for _ in "ab"]
    slots = torch.arange(num_tokens, device=device).flip(0)
    common = (weight, 1e-6, cos, sin, interleaved)
    want = torch.empty(num_tokens, heads, rank + rope, dtype=dtype, device=device)
    _, _, roped = mla_norm_rope(kv_c, k_pe, q_pe, *common, caches[0], slots, 0.05)
    head_gemv(q_nope, w_uk, out=want, tail=roped)
    got = torch.full_like(want, float("nan"))
    q, none = mla_decode_prologue(
        kv_c, k_pe, q_nope, q_pe, *common, w_uk, caches[1], slots, 0.05, joined=got
    )
    assert q is got and none is None
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[0].view(torch.uint8))


@pytest.mark.parametrize("device", [gpu_case(), cpu_case()])
def test_prologue_refuses_what_it_cannot_run(device):
    from mlaserve.ops.head_gemv import HEAD_GEMV_MAX_M
    from mlaserve.ops.mla_decode_prologue import mla_decode_prologue

    n = HEAD_GEMV_MAX_M + 1
    q_nope, q_pe, kv_c, k_pe, cos, sin, weight, w_uk = _inputs(n, device)
    cache = torch.zeros(n, 1, kv_c.shape[1] + k_pe.shape[1], dtype=kv_c.dtype, device=device)
    slots = torch.arange(n, device=device)
    common = (weight, 1e-6, cos, sin, False)
    with pytest.raises(ValueError, match="token rows"):
        mla_decode_prologue(kv_c, k_pe, q_nope, q_pe, *common, w_uk, cache, slots, 1.0)
    with pytest.raises(ValueError, match="q_nope has"):
        mla_decode_prologue(
            kv_c[:2], k_pe[:2], q_nope[:3], q_pe[:2], *common, w_uk, cache, slots, 1.0
        )
    with pytest.raises(ValueError, match="shapes"):  # mla_norm_rope's own check
        mla_decode_prologue(
            kv_c[:2], k_pe[:1], q_nope[:2], q_pe[:2], weight, 1e-6, cos[:2], sin[:2], False,
            w_uk, cache, slots, 1.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="out must be"):  # a joined query of the wrong width
        mla_decode_prologue(
            kv_c[:2], k_pe[:2], q_nope[:2], q_pe[:2], weight, 1e-6, cos[:2], sin[:2], False,
            w_uk, cache, slots[:2], 1.0, joined=q_nope[:2].contiguous(),
        )  # fmt: skip
    latent, roped = mla_decode_prologue(
        kv_c[:0], k_pe[:0], q_nope[:0], q_pe[:0], weight, 1e-6, cos[:0], sin[:0], False,
        w_uk, cache, slots[:0], 1.0,
    )  # fmt: skip
    assert latent.shape == (0, w_uk.shape[0], w_uk.shape[2]) and roped.shape[0] == 0


def test_warm_up_tasks_one_per_variant(monkeypatch):
    """`mla_decode_prologue_warm_up_tasks`: one task per (token bucket, cache dtype, with or
    without the joined query), each one call. Calls recorded, not run (CPU)."""
    from mlaserve.ops import mla_decode_prologue as module

    ran = []

    def record(kv_c, k_pe, q_nope, q_pe, weight, eps, cos, sin, inter, w_uk, cache, slots, scale,
               joined=None):  # fmt: skip
        ran.append((kv_c.shape[0], cache.dtype, None if joined is None else joined.dtype))

    monkeypatch.setattr(module, "mla_decode_prologue", record)
    heads, nope, rope, rank = 2, 16, 8, 32
    w_uk = torch.zeros(heads, nope, rank, dtype=torch.bfloat16)
    dtypes = (torch.bfloat16, torch.float8_e4m3fn)
    tasks = module.mla_decode_prologue_warm_up_tasks(
        (heads * (nope + rope), nope + rope), rank + rope, (nope, rope, rank),
        torch.ones(rank, dtype=torch.bfloat16), w_uk, False, dtypes, 5,
    )  # fmt: skip
    for task in tasks:
        task()
    expected = [(m, d, out) for m in (1, 2, 4) for d in dtypes for out in (None, d)]
    assert ran == expected
