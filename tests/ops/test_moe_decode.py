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

CASES = [
    gpu_case(t, shape, fp8)
    for t in (1, 2, 4, 8, 16)
    for shape in ("v2lite", "v3_slice", "default")
    for fp8 in (False, True)
] + [
    cpu_case(2, "tiny", False),
    cpu_case(3, "tiny_noshared", False),
    cpu_case(2, "tiny_noshared", True),
    cpu_case(1, "default", True),
]


@pytest.mark.parametrize("num_tokens,shape_name,fp8,device", CASES)
def test_moe_decode_matches_reference(num_tokens, shape_name, fp8, device):
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
    got = moe_decode(x, weights, ids, layer)
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
