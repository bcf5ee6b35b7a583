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
