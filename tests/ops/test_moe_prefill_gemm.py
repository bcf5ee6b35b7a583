"""The prefill gate_up kernel (x's rows gathered by the sorted pairs, SiLU-and-mul inside) vs
its torch reference: gather, one GEMM per expert, `silu_and_mul`.

Tolerance: the kernel and torch accumulate in fp32 in different orders, so gate and up may round
to neighbouring model-dtype values; silu and the product each round again: three steps of the
dtype (bf16 2^-8 relative) of the largest output, absolute.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.model.layers.mlp import silu_and_mul
from tests.ops.cases import cpu_case, gpu_case, model_dtype

# (T, K, E, H, I): V2-Lite's experts at prefill sizes (the kernel's range ends at 384 rows an
# expert: 4096 tokens), a width that is not a multiple of the tile; tiny ones interpreted.
CASES = [gpu_case(t, 6, 64, 2048, 1408) for t in (600, 2048, 4096)] + [
    gpu_case(333, 8, 32, 1024, 200),
    cpu_case(23, 3, 6, 64, 40),
]


def reference(x, order, counts, w13, top_k):
    xs = x[order // top_k]
    h = torch.empty(xs.shape[0], w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        h[start : start + n] = silu_and_mul(xs[start : start + n] @ w13[e].t())
        start += n
    return h


@pytest.mark.parametrize("num_tokens,top_k,num_experts,hidden,inter,device", CASES)
def test_gate_up_silu_matches_reference(num_tokens, top_k, num_experts, hidden, inter, device):
    from mlaserve.ops.moe_prefill_gemm import PrefillGemmTiles, expert_gate_up_silu

    gen = torch.Generator(device=device).manual_seed(num_tokens + inter)
    dtype = model_dtype(device)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / 30).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    logits[:, 0] += 2.0  # one expert far past the mean: several M blocks
    logits[:, -1] = -1e9  # one expert with no rows
    ids = logits.topk(top_k, dim=1).indices
    order = torch.argsort(ids.flatten(), stable=True)
    counts = torch.bincount(ids.flatten(), minlength=num_experts).to(torch.int32)
    tiles = PrefillGemmTiles(16, 16, 16, 4, 2) if device == "cpu" else None
    got = expert_gate_up_silu(x, order, counts, w13, tiles=tiles)
    want = reference(x, order, counts, w13, top_k)
    assert got.shape == want.shape and got.dtype == dtype
    step = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    torch.testing.assert_close(got, want, rtol=0, atol=3 * step * want.abs().max().item())


def test_gate_up_silu_refuses_mixed_dtypes():
    from mlaserve.ops.moe_prefill_gemm import expert_gate_up_silu

    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        expert_gate_up_silu(
            x, torch.arange(2), torch.tensor([2], dtype=torch.int32), torch.zeros(1, 4, 8)
        )
