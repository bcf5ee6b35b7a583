"""The decode MoE kernels vs an fp32 reference of routed + shared experts, bf16 and FP8 weights.

Every expert no token selects is NaN-poisoned, so a kernel that reads one fails. Tolerance:
max |err| <= 2e-2 * max |ref| (bf16 rounds gate/up, h and each expert's output, as the unfused
path does; FP8 weights are compared with their dequantised values, so only the same roundings
remain); the mean error is also bounded at 3e-3 of max |ref|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlaserve.ops.fp8_quant import dequantize_weight_block, quantize_weight_block
from tests.ops.cases import cpu_case, gpu_case, model_dtype

# name: (E, K, S, H, I)
SHAPES = {
    "v2lite": (64, 6, 2, 2048, 1408),
    "v3_slice": (16, 8, 1, 7168, 2048),  # V3's layer with 16 of its 256 experts
    "default": (8, 2, 1, 256, 128),
    "tiny": (6, 2, 2, 160, 96),  # partial blocks along H and I; no shared FP8 (I % 128)
    "tiny_noshared": (5, 3, 0, 96, 128),
}
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


def _weights(shape, fp8, dtype, device, gen):
    """Random weights in the kernels' layout; FP8 ones with block scales, plus the float values
    they stand for (the reference's)."""
    num_e, _, num_s, hidden, inter = shape

    def make(*dims, fan_in):
        return torch.randn(*dims, generator=gen, device=device) / fan_in**0.5

    ws = {
        "w13": make(num_e, 2 * inter, hidden, fan_in=hidden),
        "w2": make(num_e, hidden, inter, fan_in=inter),
    }
    if num_s:
        ws["shared_w13"] = make(2 * num_s * inter, hidden, fan_in=hidden)
        ws["shared_w2"] = make(hidden, num_s * inter, fan_in=num_s * inter)
    kernel, ref, scales = {}, {}, {}
    for name, w in ws.items():
        if fp8:
            q, s = quantize_weight_block(w, [128, 128])
            kernel[name], scales[name + "_scale"] = q, s
            ref[name] = dequantize_weight_block(q, s)
        else:
            kernel[name] = w.to(dtype)
            ref[name] = kernel[name].float()
    return kernel, ref, scales


def _reference(x, weights, ids, ref, num_shared):
    """fp32: sum_k w_k expert_{id_k}(x) + shared(x)."""
    x = x.float()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (ref["w13"][e] @ x[t]).chunk(2)
            y[t] += weights[t, k] * (ref["w2"][e] @ (F.silu(gate) * up))
    if num_shared:
        gate, up = (x @ ref["shared_w13"].T).chunk(2, dim=-1)
        y += (F.silu(gate) * up) @ ref["shared_w2"].T
    return y


@pytest.mark.parametrize("num_tokens,shape_name,fp8,device", CASES)
def test_moe_decode_matches_reference(num_tokens, shape_name, fp8, device):
    from mlaserve.ops.moe_decode import MoeDecodeWeights, moe_decode

    shape = SHAPES[shape_name]
    num_e, top_k, num_s, hidden, _ = shape
    dtype = model_dtype(device)
    gen = torch.Generator(device=device).manual_seed(num_tokens * 7 + num_e)
    kernel, ref, scales = _weights(shape, fp8, dtype, device, gen)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    ids = torch.stack(
        [torch.randperm(num_e, generator=gen, device=device)[:top_k] for _ in range(num_tokens)]
    )
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.1
    unused = torch.ones(num_e, dtype=torch.bool, device=device)
    unused[ids.flatten()] = False
    for name in ("w13", "w2"):  # a read of an unselected expert turns the output NaN
        if fp8:  # e4m3fn's NaN is 0x7f (masked_fill has no fp8 kernel)
            kernel[name].view(torch.uint8)[unused] = 0x7F
            scales[name + "_scale"][unused] = float("nan")
        else:
            kernel[name][unused] = float("nan")
    layer = MoeDecodeWeights(
        kernel["w13"],
        kernel["w2"],
        kernel.get("shared_w13"),
        kernel.get("shared_w2"),
        w13_scale=scales.get("w13_scale"),
        w2_scale=scales.get("w2_scale"),
        shared_w13_scale=scales.get("shared_w13_scale"),
        shared_w2_scale=scales.get("shared_w2_scale"),
    )
    assert layer.num_shared == num_s
    got = moe_decode(x, weights, ids, layer)
    want = _reference(x, weights, ids, ref, num_s)
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    assert not got.isnan().any()
    err = (got.float() - want).abs()
    scale = want.abs().max()
    assert err.max() <= 2e-2 * scale, f"max err {err.max() / scale:.2e} of max |ref|"
    assert err.mean() <= 3e-3 * scale, f"mean err {err.mean() / scale:.2e} of max |ref|"


def test_moe_decode_weights_refuse_mismatched_shapes():
    from mlaserve.ops.moe_decode import MoeDecodeWeights

    w13, w2 = torch.zeros(4, 2 * 32, 64), torch.zeros(4, 64, 32)
    with pytest.raises(ValueError, match="w2"):
        MoeDecodeWeights(w13, torch.zeros(4, 64, 16))
    with pytest.raises(ValueError, match="slices"):
        MoeDecodeWeights(w13, w2, torch.zeros(2 * 48, 64), torch.zeros(64, 48))
    assert MoeDecodeWeights(w13, w2, torch.zeros(2 * 64, 64), torch.zeros(64, 64)).num_shared == 2
