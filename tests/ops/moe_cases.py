"""Shared by the MoE kernel tests: layer shapes, random weights in the kernels' layout (FP8 ones
with block scales), NaN-poisoning of the experts no token selects, and the fp32 reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.ops.fp8_quant import dequantize_weight_block, quantize_weight_block

# name: (E, K, S, H, I)
SHAPES = {
    "v2lite": (64, 6, 2, 2048, 1408),
    "v3_slice": (16, 8, 1, 7168, 2048),  # V3's layer with 16 of its 256 experts
    "default": (8, 2, 1, 256, 128),
    "tiny": (6, 2, 2, 160, 96),  # partial blocks along H and I; no shared FP8 (I % 128)
    "tiny_noshared": (5, 3, 0, 96, 128),
    "tiny_fp8": (5, 2, 0, 96, 96),  # FP8 routed experts whose I is not in 128-blocks
}


def make_weights(shape, fp8, dtype, device, gen):
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


def reference(x, weights, ids, ref, num_shared):
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


def poison_unused(kernel: dict, scales: dict, ids: torch.Tensor, num_experts: int, fp8: bool):
    """NaN into every routed expert no token selects: a kernel that reads one fails."""
    unused = torch.ones(num_experts, dtype=torch.bool, device=ids.device)
    unused[ids.flatten()] = False
    for name in ("w13", "w2"):
        if fp8:  # e4m3fn's NaN is 0x7f (masked_fill has no fp8 kernel)
            kernel[name].view(torch.uint8)[unused] = 0x7F
            scales[name + "_scale"][unused] = float("nan")
        else:
            kernel[name][unused] = float("nan")


def layer_weights(kernel: dict, scales: dict):
    from mlaserve.ops.moe_decode import MoeDecodeWeights

    return MoeDecodeWeights(
        kernel["w13"],
        kernel["w2"],
        kernel.get("shared_w13"),
        kernel.get("shared_w2"),
        w13_scale=scales.get("w13_scale"),
        w2_scale=scales.get("w2_scale"),
        shared_w13_scale=scales.get("shared_w13_scale"),
        shared_w2_scale=scales.get("shared_w2_scale"),
    )


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """max |err| <= 2e-2 * max |ref|, mean |err| <= 3e-3 * max |ref|, no NaN."""
    assert not got.isnan().any()
    err = (got.float() - want).abs()
    scale = want.abs().max()
    assert err.max() <= 2e-2 * scale, f"max err {err.max() / scale:.2e} of max |ref|"
    assert err.mean() <= 3e-3 * scale, f"mean err {err.mean() / scale:.2e} of max |ref|"
