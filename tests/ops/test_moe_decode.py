"""The decode MoE kernels vs an fp32 reference of routed + shared experts, bf16 and FP8 weights.

Every expert no token selects is NaN-poisoned, so a kernel that reads one fails. Tolerance:
max |err| <= 2e-2 * max |ref| (bf16 rounds gate/up, h and each expert's output, as the unfused
path does; FP8 weights are compared with their dequantised values, so only the same roundings
remain); the mean error is also bounded at 3e-3 of max |ref|.
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

# (tokens, shape, fp8, (block_n, block_k, warps)): the FP8 scales' two paths (one scale per K block
# applied to x's slice when block_n divides 128, per row on the weights otherwise) and wide steps
TILE_CASES = [
    cpu_case(2, "default", True, ((8, 8), (256, 128), 4)),
    cpu_case(1, "default", True, ((256, 256), (64, 64), 4)),
    cpu_case(2, "tiny", False, ((4, 4), (256, 128), 4)),
    gpu_case(1, "v2lite", True, ((16, 16), (128, 128), 8)),
    gpu_case(4, "v2lite", True, ((256, 256), (128, 64), 4)),
    gpu_case(3, "v3_slice", True, ((4, 8), (2048, 1024), 4)),
    gpu_case(2, "v2lite", False, ((8, 8), (512, 512), 4)),
]
CASES = (
    [
        gpu_case(t, shape, fp8, None)
        for t in (1, 2, 4, 8, 16)
        for shape in ("v2lite", "v3_slice", "default")
        for fp8 in (False, True)
    ]
    + [
        cpu_case(2, "tiny", False, None),
        cpu_case(3, "tiny_noshared", False, None),
        cpu_case(2, "tiny_noshared", True, None),
        cpu_case(1, "default", True, None),
    ]
    + TILE_CASES
)


@pytest.mark.parametrize("num_tokens,shape_name,fp8,tiles,device", CASES)
def test_moe_decode_matches_reference(num_tokens, shape_name, fp8, tiles, device):
    from mlaserve.ops.moe_decode import moe_decode

    shape = SHAPES[shape_name]
    num_e, top_k, num_s, hidden, _ = shape
    dtype = model_dtype(device)
    gen = torch.Generator(device=device).manual_seed(num_tokens * 7 + num_e)
    kernel, ref, scales = make_weights(shape, fp8, dtype, device, gen)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    ids = torch.stack(
        [torch.randperm(num_e, generator=gen, device=device)[:top_k] for _ in range(num_tokens)]
    )
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.1
    poison_unused(kernel, scales, ids, num_e, fp8)
    layer = layer_weights(kernel, scales)
    assert layer.num_shared == num_s
    if tiles is None:  # decode_tiles' defaults
        got = moe_decode(x, weights, ids, layer)
    else:
        block_n, block_k, warps = tiles
        got = moe_decode(x, weights, ids, layer, block_n=block_n, block_k=block_k, num_warps=warps)
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    assert_close_to_reference(got, reference(x, weights, ids, ref, num_s))


def test_moe_decode_weights_refuse_mismatched_shapes():
    from mlaserve.ops.moe_decode import MoeDecodeWeights

    w13, w2 = torch.zeros(4, 2 * 32, 64), torch.zeros(4, 64, 32)
    with pytest.raises(ValueError, match="w2"):
        MoeDecodeWeights(w13, torch.zeros(4, 64, 16))
    with pytest.raises(ValueError, match="slices"):
        MoeDecodeWeights(w13, w2, torch.zeros(2 * 48, 64), torch.zeros(64, 48))
    assert MoeDecodeWeights(w13, w2, torch.zeros(2 * 64, 64), torch.zeros(64, 64)).num_shared == 2


def test_moe_decode_refuses_wide_steps_with_per_row_scales():
    from mlaserve.ops.moe_decode import moe_decode

    gen = torch.Generator().manual_seed(0)
    kernel, _, scales = make_weights(SHAPES["default"], True, torch.float32, "cpu", gen)
    x = torch.zeros(1, SHAPES["default"][3])
    ids, weights = torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2)
    with pytest.raises(ValueError, match="block_k"):
        moe_decode(
            x, weights, ids, layer_weights(kernel, scales), block_n=(256, 8), block_k=(256, 64)
        )


# (tokens, shape, fp8, routing: (scoring, topk_method, n_group, topk_group, norm, scaling, bias))
V2_ROUTING = ("softmax", "greedy", 1, 1, False, 1.0, False)
V3_ROUTING = ("sigmoid", "noaux_tc", 4, 2, True, 2.5, True)
ROUTING_CASES = [
    gpu_case(t, shape, fp8, r)
    for t in (1, 2, 8)
    for shape, r in (("v2lite", V2_ROUTING), ("v3_slice", V3_ROUTING))
    for fp8 in (False, True)
] + [
    cpu_case(2, "tiny", False, V2_ROUTING),
    cpu_case(1, "default", True, ("softmax", "group_limited_greedy", 2, 1, True, 1.0, False)),
    cpu_case(3, "tiny_noshared", False, (*V3_ROUTING[:2], 1, 1, *V3_ROUTING[4:])),
]


@pytest.mark.parametrize("num_tokens,shape_name,fp8,routing,device", ROUTING_CASES)
def test_selection_inside_the_first_kernel_equals_selecting_first(
    num_tokens, shape_name, fp8, routing, device
):
    """`routing=`: the gate_up kernel selects the experts from the router logits itself; the
    weights and ids it fills and the layer's output have the bits of `fused_select_experts`
    followed by `moe_decode` (the same selection code, the same kernels after it)."""
    from mlaserve.ops.moe_decode import moe_decode
    from mlaserve.ops.routing import fused_select_experts, plan_routing

    shape = SHAPES[shape_name]
    num_e, top_k, _, hidden, _ = shape
    dtype = model_dtype(device)
    gen = torch.Generator(device=device).manual_seed(num_tokens * 11 + num_e)
    kernel, _, scales = make_weights(shape, fp8, dtype, device, gen)
    layer = layer_weights(kernel, scales)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(num_tokens, num_e, generator=gen, device=device) * 2
    scoring, method, groups, topk_group, norm, scaling, bias = routing
    kw = {
        "top_k": top_k,
        "scoring_func": scoring,
        "topk_method": method,
        "n_group": groups,
        "topk_group": topk_group,
        "norm_topk_prob": norm,
        "routed_scaling_factor": scaling,
        "correction_bias": torch.rand(num_e, generator=gen, device=device) if bias else None,
    }
    want_w, want_ids = fused_select_experts(logits, **kw)
    want = moe_decode(x, want_w, want_ids, layer)
    plan = plan_routing(logits, **kw)
    got = moe_decode(x, plan.weights, plan.ids, layer, routing=plan)
    assert torch.equal(plan.ids, want_ids)
    assert torch.equal(plan.weights, want_w)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="its own weights and ids"):
        moe_decode(x, want_w, want_ids, layer, routing=plan)
