"""The router-logits kernel vs fp64 math: bf16 activations against the fp32 gate.

Bound: |err| <= 1e-5 * (|x| @ |w|^T) elementwise, i.e. fp32-GEMM accuracy relative to the sum
of the magnitudes of the products (tf32x3 rounds the gate's low bits at ~2^-22; a plain TF32
product would miss it by ~100x). Token counts: none (a prefill chunk without logits rows), below,
at and past 16-row tiles and multiples of 16, and prefill-sized counts that take the
64-expert-wide tiles (V3 from 256 tokens, V2-Lite from 1024); expert counts of V2-Lite, V3 and
the default model.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case, model_dtype

# name: (E, H)
SHAPES = {"v2lite": (64, 2048), "v3": (256, 7168), "default": (8, 256), "tiny": (12, 160)}
CASES = [
    gpu_case(t, shape)
    for t in (0, 9, 17, 32, 64, 128, 257, 1000, 2048, 4100)
    for shape in ("v2lite", "v3", "default")
] + [cpu_case(5, "tiny"), cpu_case(33, "default"), cpu_case(1009, "tiny"), cpu_case(3, "v3")]
CASES.append(cpu_case(0, "v3"))


@pytest.mark.parametrize("num_tokens,shape_name,device", CASES)
def test_router_logits_match_fp64(num_tokens, shape_name, device):
    from mlaserve.ops.router_logits import router_logits

    num_experts, hidden = SHAPES[shape_name]
    gen = torch.Generator(device=device).manual_seed(num_tokens + num_experts)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(model_dtype(device))
    w = torch.randn(num_experts, hidden, generator=gen, device=device) / hidden**0.5
    got = router_logits(x, w).sum(0)  # split-K partials, summed in order
    want = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, num_experts)
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"worst err / bound {(err / bound).max():.3g}"


def test_router_logits_refuses_a_non_fp32_gate():
    from mlaserve.ops.router_logits import router_logits

    with pytest.raises(ValueError, match="fp32"):
        router_logits(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.bfloat16))


def test_prefill_sized_batches_take_wide_tiles_split_while_few():
    triton = pytest.importorskip("triton")
    from mlaserve.ops.router_logits import _tiles, router_logits_variants

    # decode sizes: a small gate (V2-Lite's 512 KB) wide, in one 128-wide step a program; a
    # large one (V3's 7.3 MB) narrow and split while a handful of tokens leave too few programs
    assert _tiles(1, 64, 2048) == _tiles(128, 64, 2048) == (16, 64, 128, 16)
    assert _tiles(512, 64, 2048) == (16, 64, 128, 16)
    assert _tiles(1, 256, 7168) == _tiles(16, 256, 7168) == (16, 32, 128, 28)  # 56 K blocks
    assert _tiles(32, 256, 7168) == (16, 32, 128, 14)
    assert _tiles(64, 256, 7168) == (16, 32, 128, 8)
    assert _tiles(128, 256, 7168) == (16, 64, 128, 8)
    # prefill sizes: 64 wide tiles, K split while the 16-row count stays within 1024 programs
    assert _tiles(1024, 64, 2048) == (64, 64, 64, 16)
    assert _tiles(2048, 64, 2048) == (64, 64, 64, 8)
    assert _tiles(8192, 64, 2048) == (64, 64, 64, 2)
    assert _tiles(16384, 64, 2048) == (64, 64, 64, 1)  # 256 tiles: enough programs unsplit
    assert _tiles(256, 256, 7168) == (64, 64, 64, 16)
    assert _tiles(1009, 12, 160) == (64, 64, 64, 1)  # the interpreted case above: K of 3 blocks
    every = range(1, 17000)
    for num_experts, hidden in ((64, 2048), (256, 7168)):
        counts = router_logits_variants(num_experts, hidden)
        variants = {_tiles(t, num_experts, hidden) for t in every}
        assert {_tiles(t, num_experts, hidden) for t in counts} == variants
        for *_, block_k, splits in variants:  # a split is whole K blocks: none left over
            assert triton.cdiv(hidden, block_k) % splits == 0
