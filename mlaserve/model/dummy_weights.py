"""Random weights for `--load-format dummy` (vLLM's name): a built model filled on its own device,
from config.json alone, for benchmarks at full width without a checkpoint.

Every parameter is filled where it already lives (no CPU copy of the model, no safetensors read),
from its own generator seeded by (engine seed, parameter name), so a model is the same whatever
order its parameters come in, and replicated weights agree on every TP rank. Shapes come from the
parameters, which are per rank already.

    RMSNorm weights        1
    1-D others             0   (biases; the router's score-correction bias: a bias larger than
                                the scores' spread would send every token to the same experts)
    matrices [..., K]      uniform(-a, a), a = sqrt(3 / fan_in)   (variance 1 / fan_in)
    FP8 matrices           e4m3 values uniform(-448, 448), every block scale a / 448: the same
                           W = W_fp8 * scale, with block scales of the checkpoint's layout

fan_in is the layer's whole input width (not a row-parallel rank's slice), so a normalised
input of unit variance gives outputs of unit variance: each sublayer adds O(1) to the residual,
which RMSNorm brings back to unit scale before the next, so activations stay O(1) through any
depth in bf16, attention scores q.k / sqrt(d) are O(1), and the router's logits are O(1) and
differ per token (routing spread over the experts, as the bytes floor of a MoE step assumes).
vLLM's uniform(-1e-3, 1e-3) also stays finite (measured on CPU: the default model, a 27-layer
V3-lite-shaped one, bf16 and FP8), but flat: the embedding's mean square (3e-7) is below
RMSNorm's eps (1e-6), so normed inputs are ~0.5, sublayer outputs ~1e-3 of their input, logits
std 0.005; k_pe of ~0.01 is coarse in an FP8 KV cache, and FP8 weights of 1e-3 round to 0 in
e4m3 (hence e4m3 values at full range and the magnitude in the scale, as a real checkpoint).

The derived buffers (absorbed W_UK / W_UV, the MoE kernels' views) are made afterwards by
`process_weights_after_loading`, as after a real load.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from mlaserve.model.layers.moe_expert_weights import ExpertWeights
from mlaserve.model.layers.norm import RMSNorm
from mlaserve.ops.fp8_quant import FP8_DTYPE, FP8_MAX

__all__ = ["fill_dummy_weights"]

_SCALE_SUFFIX = (
    "_scale_inv"  # X.weight -> X.weight_scale_inv, experts.gate_up_proj -> ..._scale_inv
)
# Largest temporary (elements) while drawing an FP8 tensor: one V3 expert's gate_up is 29M.
_CHUNK_ELEMENTS = 1 << 26


def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` in place (see the module docstring); tied ones once."""
    done: set[int] = set()
    for prefix, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if attr.endswith(_SCALE_SUFFIX) or id(param) in done:
                continue  # block scales: filled with their weight
            done.add(id(param))
            name = f"{prefix}.{attr}" if prefix else attr
            g = torch.Generator(param.device).manual_seed(_seed_of(seed, name))
            with torch.no_grad():
                _fill(module, attr, param, g)


def _fill(module: nn.Module, attr: str, param: nn.Parameter, g: torch.Generator) -> None:
    data = param.data
    if isinstance(module, RMSNorm):
        data.fill_(1.0)
    elif data.dim() == 1:
        data.zero_()
    elif data.dtype == FP8_DTYPE:
        scale = getattr(module, attr + _SCALE_SUFFIX, None)
        if scale is None:  # internal: every FP8 weight is made with its scale (fp8_linear.py)
            raise AssertionError(f"{attr}: FP8 weight without {attr}{_SCALE_SUFFIX}")
        _fill_fp8(data, g)
        scale.data.fill_(_bound(module, attr, data) / FP8_MAX)
    else:
        bound = _bound(module, attr, data)
        data.uniform_(-bound, bound, generator=g)


def _fill_fp8(weight: torch.Tensor, g: torch.Generator) -> None:
    """e4m3 values uniform over (-448, 448), drawn in row chunks: the temporary stays small."""
    rows = weight.view(-1, weight.shape[-1])
    step = max(1, _CHUNK_ELEMENTS // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        part = rows[start : start + step]
        tmp = torch.empty(part.shape, dtype=torch.bfloat16, device=part.device)
        part.copy_(tmp.uniform_(-FP8_MAX, FP8_MAX, generator=g))


def _bound(module: nn.Module, attr: str, weight: torch.Tensor) -> float:
    """a = sqrt(3 / fan_in): uniform(-a, a) has variance 1 / fan_in."""
    return math.sqrt(3.0 / _fan_in(module, attr, weight))


def _fan_in(module: nn.Module, attr: str, weight: torch.Tensor) -> int:
    """The layer's whole input width: under TP a row-parallel rank holds a slice of it, and its
    partial sums add up over the ranks."""
    if isinstance(module, ExpertWeights):  # down_proj's last dim is the TP-split intermediate
        return module.hidden_size if attr == "gate_up_proj" else module.intermediate_size
    return getattr(module, "in_features", weight.shape[-1])  # linears; else [..., K] as stored


def _seed_of(seed: int, name: str) -> int:
    """A 63-bit seed per (engine seed, parameter name): stable across runs and processes."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
