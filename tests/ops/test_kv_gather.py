"""The fp8 cache's gather-and-dequantise kernel vs torch's byte gather, e4m3 cast and scale
multiply (`mha_extend.gather_context_latent`'s reference path): the same bits."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case

# (slots gathered, row width D, out dtype, scale): a 2048-token V2-Lite prefill's context, a
# width that is not a power of two; tiny ones interpreted
CASES = [
    gpu_case(s, 576, dtype, scale)
    for s in (1, 17, 2048)
    for dtype in (torch.bfloat16, torch.float32)
    for scale in (1.0, 0.0173)
] + [gpu_case(300, 100, torch.float16, 2.5), cpu_case(7, 40, torch.float32, 0.37)]


@pytest.mark.parametrize("num_slots,dim,dtype,scale,device", CASES)
def test_gather_dequant_matches_torch(num_slots, dim, dtype, scale, device):
    from mlaserve.ops.kv_gather import gather_dequant

    gen = torch.Generator(device=device).manual_seed(num_slots + dim)
    num_rows = 4 * num_slots + 5
    values = torch.randn(num_rows, dim, generator=gen, device=device) * 200
    cache = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    slots = torch.randperm(num_rows, generator=gen, device=device)[:num_slots]
    got = gather_dequant(cache, slots, scale, dtype)
    want = cache.view(torch.uint8)[slots].view(torch.float8_e4m3fn).to(dtype) * scale
    assert got.dtype == want.dtype == dtype and got.shape == (num_slots, dim)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()


def test_gather_dequant_refuses_other_caches():
    from mlaserve.ops.kv_gather import gather_dequant

    with pytest.raises(ValueError, match="e4m3 cache"):
        gather_dequant(torch.zeros(4, 8), torch.arange(2), 1.0, torch.float32)


@pytest.mark.parametrize(
    "num_slots,dtype,device",
    [gpu_case(600, torch.bfloat16), cpu_case(9, torch.float32)],
)
def test_context_latent_through_the_kernel_has_torchs_bits(num_slots, dtype, device):
    """`mha_extend.gather_context_latent` with the kernel as its `dequant` (how FlashMLA's
    prefill calls it) equals its torch path on an fp8 pool."""
    from mlaserve.kernels_adapter.mha_extend import fresh_layout, gather_context_latent
    from mlaserve.kv_cache import MLAKVPool
    from mlaserve.ops.kv_gather import gather_dequant

    pool = MLAKVPool(2, 40, 16, 32, 8, torch.float8_e4m3fn, device, k_scale=[0.5, 0.0173])
    gen = torch.Generator(device=device).manual_seed(num_slots)
    for buf in pool.kv_buffers:
        values = torch.randn(buf.shape, generator=gen, device=device) * 100
        buf.copy_(values.to(torch.float8_e4m3fn))
    slots = torch.randperm(40 * 16, generator=gen, device=device)[:num_slots]
    layout = fresh_layout(slots)
    for layer in range(2):
        want = gather_context_latent(pool, layer, layout, dtype)
        got = gather_context_latent(pool, layer, layout, dtype, dequant=gather_dequant)
        assert got.shape == (num_slots, pool.dim) and got.dtype == dtype
        assert torch.equal(got, want), layer
