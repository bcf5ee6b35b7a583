"""The grouped MoE kernels vs the fp32 reference of routed + shared experts, bf16 and FP8 weights.

Tolerances and NaN-poisoned unselected experts as in test_moe_decode.py (the same roundings).
Routing is random (a few rows per expert) or concentrated (every token picks the same experts,
so an expert's rows span several BLOCK_M blocks); token counts include ones whose pairs are not
a multiple of 16 and ones past a power of two. The kernels must also agree with `moe_decode` to
the last bit where neither rounds differently: they are the same math on other tiles.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case, model_dtype
from tests.ops.moe_cases import (
    SHAPES,
    assert_close_to_reference,
    layer_weights,
    make_weights,
    poison_unused,
    reference,
)

CASES = (
    [
        gpu_case(t, shape, fp8, routing)
        for t in (9, 33, 64, 130, 256)
        for shape in ("v2lite", "v3_slice", "default")
        for fp8 in (False, True)
        for routing in ("random", "concentrated")
    ]
    + [  # bf16 takes them up to 512 tokens (`moe.GROUPED_MAX_TOKENS`)
        gpu_case(t, shape, False, routing)
        for t in (300, 512)
        for shape in ("v2lite", "default")
        for routing in ("random", "concentrated")
    ]
    + [
        cpu_case(5, "tiny", False, "random"),
        cpu_case(20, "default", False, "concentrated"),
        cpu_case(7, "tiny_noshared", True, "random"),
        cpu_case(9, "default", True, "concentrated"),
    ]
)


def _routing(routing, num_tokens, num_e, top_k, gen, device):
    if routing == "concentrated":  # the same top_k experts for every token
        chosen = torch.randperm(num_e, generator=gen, device=device)[:top_k]
        return chosen.expand(num_tokens, top_k).contiguous()
    return torch.stack(
        [torch.randperm(num_e, generator=gen, device=device)[:top_k] for _ in range(num_tokens)]
    )


@pytest.mark.parametrize("num_tokens,shape_name,fp8,routing,device", CASES)
def test_moe_grouped_matches_reference(num_tokens, shape_name, fp8, routing, device):
    from mlaserve.ops.moe_grouped import moe_grouped

    shape = SHAPES[shape_name]
    num_e, top_k, num_s, hidden, _ = shape
    dtype = model_dtype(device)
    gen = torch.Generator(device=device).manual_seed(num_tokens * 5 + num_e)
    kernel, ref, scales = make_weights(shape, fp8, dtype, device, gen)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    ids = _routing(routing, num_tokens, num_e, top_k, gen, device)
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.1
    poison_unused(kernel, scales, ids, num_e, fp8)
    layer = layer_weights(kernel, scales)
    got = moe_grouped(x, weights, ids, layer, block_m=16 if device == "cpu" else None)
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    assert_close_to_reference(got, reference(x, weights, ids, ref, num_s))
    again = moe_grouped(x, weights, ids, layer, block_m=16 if device == "cpu" else None)
    assert torch.equal(got, again), "the order of rows within an expert changed the result"


def test_moe_grouped_refuses_fp32_and_mismatched_input():
    from mlaserve.ops.moe_decode import MoeDecodeWeights
    from mlaserve.ops.moe_grouped import moe_grouped

    layer = MoeDecodeWeights(torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        moe_grouped(torch.zeros(2, 64), torch.ones(2, 2), ids, layer)
    with pytest.raises(ValueError, match="tokens"):
        moe_grouped(torch.zeros(3, 64, dtype=torch.float16), torch.ones(2, 2), ids, layer)


def test_block_m_grows_with_rows_per_expert():
    from mlaserve.ops.moe_grouped import moe_grouped_block_m

    assert moe_grouped_block_m(64 * 8, 66) == 16  # V2-Lite bs 64: ~8 rows per expert
    assert moe_grouped_block_m(256 * 8, 66) == 32
    assert moe_grouped_block_m(256 * 8, 9) == 64
