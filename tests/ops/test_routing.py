"""Fused routing vs `select_experts` for the three DeepSeek routers. Tolerance: the same expert
sets (compared sorted by id: the reference's order is unspecified), weights rtol 1e-5, atol 1e-6
(softmax/sigmoid differ in the last fp32 bits)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.model.layers.moe import select_experts
from tests.ops.cases import GPU_TOKENS, cpu_case, gpu_case

# name: (experts, select_experts kwargs)
ROUTERS = {
    "v2lite": (64, dict(top_k=6, scoring_func="softmax", topk_method="greedy", n_group=1,
                        topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    "v2": (160, dict(top_k=6, scoring_func="softmax", topk_method="group_limited_greedy",
                     n_group=8, topk_group=3, norm_topk_prob=False, routed_scaling_factor=16.0)),
    "v3": (256, dict(top_k=8, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8,
                     topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "tiny_v2": (16, dict(top_k=3, scoring_func="softmax", topk_method="group_limited_greedy",
                         n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.0)),
    "tiny_v3": (16, dict(top_k=3, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                         topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "tiny_greedy": (12, dict(top_k=4, scoring_func="softmax", topk_method="greedy", n_group=1,
                             topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)),
}  # fmt: skip
CASES = [gpu_case(t, r) for t in GPU_TOKENS for r in ("v2lite", "v2", "v3")] + [
    cpu_case(3, r) for r in ("tiny_v2", "tiny_v3", "tiny_greedy")
]


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("num_tokens,router,device", CASES)
def test_routing_matches_reference(num_tokens, router, device, splits):
    """splits > 1: the kernel is given split-K partials of the logits (`ops.router_logits`'
    output), which it sums in order; the reference gets the same sum."""
    from mlaserve.ops.routing import fused_select_experts

    num_experts, kw = ROUTERS[router]
    g = torch.Generator(device=device).manual_seed(num_tokens + num_experts)
    partials = torch.randn(splits, num_tokens, num_experts, generator=g, device=device)
    logits = partials[0]
    for part in partials[1:]:  # the kernel's order
        logits = logits + part
    if kw["topk_method"] == "noaux_tc":
        kw = dict(kw, correction_bias=torch.randn(num_experts, generator=g, device=device) * 0.1)
    weights, ids = fused_select_experts(partials if splits > 1 else logits, **kw)
    want_weights, want_ids = select_experts(logits, **kw)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    ids, order = ids.sort(dim=-1)
    want_ids, want_order = want_ids.sort(dim=-1)
    torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
    torch.testing.assert_close(
        weights.gather(1, order), want_weights.gather(1, want_order), rtol=1e-5, atol=1e-6
    )
