"""The sorted MoE path's combine kernel vs its torch reference (`FusedExperts._forward_sorted`'s
unsort, fp32 weighting, sum over slots, downcast, + shared), and the sorted path on CUDA with
its Triton kernels vs the same path in torch.

Tolerance: two roundings to the model dtype (the slot sum, then + shared), which the kernel and
torch make alike; they differ only where fp32 summation order or an FMA moves the slot sum across
a rounding boundary, by one step of the sum's magnitude, which survives + shared even where that
cancels the sum: two bf16 steps (2^-7) of the largest output magnitude, absolute.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case, model_dtype

# (T, K, H): V2-Lite's top-6 over hidden 2048 at decode, odd and prefill sizes; V3's top-8 / 7168.
CASES = [gpu_case(t, 6, 2048) for t in (1, 7, 2048)] + [
    gpu_case(300, 8, 7168),
    cpu_case(5, 3, 40),
    cpu_case(2, 2, 1100),
]


def reference(rows, order, weights, shared):
    num_tokens, top_k = weights.shape
    unsorted = torch.empty_like(rows).index_copy_(0, order, rows)
    y = (unsorted.view(num_tokens, top_k, -1).float() * weights[..., None]).sum(1).to(rows.dtype)
    return y if shared is None else y + shared


@pytest.mark.parametrize("with_shared", [True, False])
@pytest.mark.parametrize("num_tokens,top_k,hidden,device", CASES)
def test_sorted_combine_matches_reference(num_tokens, top_k, hidden, device, with_shared):
    from mlaserve.ops.moe_sorted_combine import moe_sorted_combine

    gen = torch.Generator(device=device).manual_seed(num_tokens * top_k + hidden)
    dtype = model_dtype(device)
    rows = torch.randn(num_tokens * top_k, hidden, generator=gen, device=device).to(dtype)
    ids = torch.randint(0, 64, (num_tokens * top_k,), generator=gen, device=device)
    order = torch.argsort(ids, stable=True)
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device)
    shared = None
    if with_shared:
        shared = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    got = moe_sorted_combine(rows, order, weights, shared)
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    want = reference(rows, order, weights, shared)
    torch.testing.assert_close(got, want, rtol=0, atol=2**-7 * want.abs().max().item())


def test_sorted_combine_refuses_mismatched_pairs():
    from mlaserve.ops.moe_sorted_combine import moe_sorted_combine

    with pytest.raises(ValueError, match="pairs"):
        moe_sorted_combine(torch.zeros(6, 4), torch.arange(6), torch.zeros(2, 2))


@pytest.mark.parametrize("quant", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens,device", [gpu_case(300), gpu_case(2048)])
def test_sorted_path_kernels_match_torch(num_tokens, device, quant):
    """The routed experts past the grouped kernels' sizes (prefill): the sort, the bf16 gate_up
    GEMM with SiLU-and-mul, SiLU-and-mul and the combine as Triton kernels vs the torch reference, same weights and routing, V2-Lite's
    expert shape (64 experts of 1408, hidden 2048, top-6)."""
    from mlaserve.config import QuantizationConfig
    from mlaserve.model.layers.mlp import silu_and_mul
    from mlaserve.model.layers.moe import FusedExperts

    torch.manual_seed(num_tokens)
    q = QuantizationConfig() if quant else None
    with torch.device(device):
        experts = FusedExperts(64, 2048, 1408, params_dtype=torch.bfloat16, quant=q)
    if quant:
        experts.gate_up_proj.data.copy_(torch.randn_like(experts.gate_up_proj, dtype=torch.float))
        experts.down_proj.data.copy_(torch.randn_like(experts.down_proj, dtype=torch.float))
        experts.gate_up_proj_scale_inv.data.fill_(0.02)
        experts.down_proj_scale_inv.data.fill_(0.02)
    else:
        experts.gate_up_proj.data.normal_(std=0.02)
        experts.down_proj.data.normal_(std=0.02)
    assert experts._sorted_combine is not None and experts.act is not silu_and_mul
    x = torch.randn(num_tokens, 2048, device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(64, device=device)[:6] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, 6, device=device)
    shared = torch.randn(num_tokens, 2048, device=device, dtype=torch.bfloat16)
    got = experts(x, weights, ids, shared)
    assert experts._sort_by_expert is not None and (experts._gate_up_silu is None) == quant
    experts.act, experts._sorted_combine, experts._sort_by_expert = silu_and_mul, None, None
    experts._gate_up_silu = None
    want = experts(x, weights, ids, shared)
    torch.testing.assert_close(got, want, rtol=0, atol=2**-7 * want.abs().max().item())
