"""Rotary position embedding for the `qk_rope_head_dim` part of MLA, with DeepSeek's YaRN.

Matches transformers 5 (`_compute_yarn_parameters`, DeepseekV2/V3 `apply_rotary_emb*`):

* inverse frequencies: plain RoPE, or YaRN's blend of interpolated (divided by `factor`) and
  extrapolated frequencies with a linear ramp between the `beta_fast`/`beta_slow` correction
  dimensions (floored/ceiled, as DeepSeek's `truncate=True`);
* cos/sin are multiplied by YaRN's attention factor
  `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`, so q_pe.k_pe picks up its square.
  The *softmax* correction `mscale(factor, mscale_all_dim)^2` is separate and lives in
  `ModelConfig.softmax_scale`;
* rotation pairs: interleaved `(x0, x1), (x2, x3), ...` (DeepSeek's layout; always for V2,
  `rope_interleave=True` for V3) or halves `(x_i, x_{i+d/2})` (`rope_interleave=False`).

The output is always laid out "de-interleaved" `[rotated first members | rotated second
members]` (transformers V3's layout; V2 keeps pairs interleaved). Attention only ever takes
q_pe . k_pe with q and k permuted alike, so the layout is invisible outside the model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mlaserve.config import ModelConfig
from mlaserve.ops import fused_ops_enabled

__all__ = ["RotaryEmbedding", "apply_rope", "rope_inv_freq", "yarn_get_mscale"]


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [rope_dim / 2] fp32 on CPU, attention factor applied to cos/sin)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    # On the CPU whatever the model device: bit-identical to transformers.
    dims = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")
    pos_freqs = base ** (dims / dim)  # [dim/2]
    rs = config.rope_scaling
    if rs is None:
        return 1.0 / pos_freqs, 1.0

    factor = rs.factor
    if rs.attention_factor is not None:
        attention_factor = rs.attention_factor
    elif rs.mscale and rs.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, rs.mscale)
        attention_factor /= yarn_get_mscale(factor, rs.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times in the original context.
        ratio = rs.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((dims / 2 - low) / (high - low)).clamp(0, 1)  # dims / 2 = 0, 1, ..., dim/2 - 1
    keep = 1 - ramp  # 1 = keep the original frequency (the fast-rotating dims)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """positions -> (cos, sin), computed per forward (no table: any position, graph-safe); on
    CUDA in one kernel (`ops/rotary_cos_sin.py`, the same bits as the torch reference here)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(config)
        device = torch.get_default_device()
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.interleaved = config.model_type == "deepseek_v2" or config.rope_interleave
        self._fused = fused_ops_enabled(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, rope_dim / 2] fp32 (attention factor applied)"""
        if self._fused:
            from mlaserve.ops.rotary_cos_sin import rotary_cos_sin

            return rotary_cos_sin(positions, self.inv_freq, self.attention_factor)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [T, ..., rope_dim]; cos/sin [T, rope_dim / 2] -> rotated x, same shape and dtype.

    Computed in fp32 (as transformers V2 does) whatever the model dtype."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
