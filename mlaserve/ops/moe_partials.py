"""An MoE layer's output before its combine (no Triton needed to import it)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MoePartials"]


class MoePartials(NamedTuple):
    """An MoE layer's output before its combine: one fp32 row per (token, slot), whose sum over
    the slots in order, rounded to `dtype`, is the layer's output. The next residual-add +
    RMSNorm takes it as it is (`ops.rms_norm.add_partials_rms_norm`: the combine in the norm's
    launch); `total()` is the combined [T, H] tensor for anything else."""

    parts: torch.Tensor  # [T, slots, H] fp32
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        num_tokens, slots, hidden = self.parts.shape
        y = torch.empty(num_tokens, hidden, dtype=self.dtype, device=self.parts.device)
        if num_tokens:
            from mlaserve.ops.moe_decode import combine_partials

            combine_partials(self.parts.view(num_tokens * slots, hidden), y, slots)
        return y
