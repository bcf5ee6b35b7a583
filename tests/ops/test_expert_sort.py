"""The counting sort of a routing's (token, slot) pairs by expert vs torch: the same stable
order as `torch.argsort(ids.flatten(), stable=True)`, exactly, and its token, inverse and counts."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case

# (T, K, E): V2-Lite's top-6 of 64 at decode, odd and prefill sizes (one chunk; 12 and 48 chunks
# of 1024 pairs); V3's top-8 of 256 up to the kernels' limit; tiny ones under the interpreter,
# one of them over 9 chunks, the last one partial.
CASES = [gpu_case(t, 6, 64) for t in (1, 7, 2048, 8192)] + [
    gpu_case(300, 8, 256),
    gpu_case(5000, 8, 256),
    gpu_case(8192, 8, 256),  # EXPERT_SORT_MAX_PAIRS
    cpu_case(37, 3, 8),
    cpu_case(1500, 6, 8),
]


@pytest.mark.parametrize("num_tokens,top_k,num_experts,device", CASES)
def test_sort_by_expert_is_torchs_stable_sort(num_tokens, top_k, num_experts, device):
    from mlaserve.ops.expert_sort import sort_by_expert

    gen = torch.Generator(device=device).manual_seed(num_tokens + num_experts)
    # a skewed routing: some experts get many pairs, the last few none
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    logits[:, : num_experts // 8] += 1.5
    dead = min(3, num_experts - top_k - 1)
    logits[:, num_experts - dead :] = -1e9
    ids = logits.topk(top_k, dim=1).indices
    got = sort_by_expert(ids, num_experts)
    want = torch.argsort(ids.flatten(), stable=True)
    assert torch.equal(got.order, want)
    assert torch.equal(got.token, want // top_k)
    counts = torch.bincount(ids.flatten(), minlength=num_experts).to(torch.int32)
    assert torch.equal(got.counts, counts) and int(got.counts[num_experts - dead :].sum()) == 0
    inverse = torch.empty_like(want)
    inverse[want] = torch.arange(want.numel(), device=device)
    assert got.pos.dtype == torch.int32 and torch.equal(got.pos.long(), inverse)


def test_sort_by_expert_refuses_float_ids():
    from mlaserve.ops.expert_sort import sort_by_expert

    with pytest.raises(ValueError, match="integer ids"):
        sort_by_expert(torch.zeros(4, 2), 8)
