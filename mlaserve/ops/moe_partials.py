"""An MoE layer's output before its combine, in the two forms the fused paths leave it in (no
Triton needed to import them). The next residual-add + RMSNorm takes either as it is and does the
combine in its own launch (`model.layers.norm.RMSNorm.forward_with_residual`); `total()` is the
combined [T, H] tensor for anything else."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MoePartials", "SortedExpertRows"]


class MoePartials(NamedTuple):
    """The decode and grouped kernels' form: one fp32 row per (token, slot), whose sum over the
    slots in order, rounded to `dtype`, is the layer's output (`ops.rms_norm.
    add_partials_rms_norm` sums it in the norm's launch)."""

    parts: torch.Tensor  # [T, slots, H] fp32
    dtype: torch.dtype

    @classmethod
    def empty(cls, x: torch.Tensor, slots: int) -> MoePartials:
        """The partials of no tokens ([0, slots, H] fp32) for x [0, H]: the kernels' form for
        an empty batch too (the last layer of a prefill chunk without logits rows)."""
        return cls(x.new_empty(0, slots, x.shape[1], dtype=torch.float32), x.dtype)

    def total(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[T, H]: the slots summed in order, rounded to `dtype` (default `self.dtype`; fp32:
        unrounded, a tensor-parallel rank's share before the all-reduce)."""
        num_tokens, slots, hidden = self.parts.shape
        y = torch.empty(num_tokens, hidden, dtype=dtype or self.dtype, device=self.parts.device)
        if num_tokens:
            # here, not at the top: importing this module needs no Triton (a leaf, no cycle)
            from mlaserve.ops.moe_partials_combine import combine_partials

            combine_partials(self.parts.view(num_tokens * slots, hidden), y, slots)
        return y


class SortedExpertRows(NamedTuple):
    """The sorted (prefill) path's form (`FusedExperts._forward_sorted`): each (token, slot)
    pair's expert output row, grouped by expert. The layer's output is

        y[t] = round(sum_k weights[t, k] * rows[pos[t * K + k]])   (fp32 sum in slot order)
               (+ shared[t], rounded again)

    which `ops.moe_sorted_combine` computes and `ops.rms_norm.add_sorted_rms_norm` folds into
    the norm's launch (the same bits; the [T, H] sum is never written)."""

    rows: torch.Tensor  # [T*K, H] the model's dtype, contiguous, sorted by expert
    order: torch.Tensor  # [T*K] int64: sorted position -> pair
    pos: torch.Tensor  # [T*K] int32: pair -> sorted position (order's inverse)
    weights: torch.Tensor  # [T, K] fp32, `routed_scaling_factor` applied
    shared: torch.Tensor | None  # [T, H] the shared experts' output, or None

    def total(self) -> torch.Tensor:
        from mlaserve.ops.moe_sorted_combine import moe_sorted_combine

        return moe_sorted_combine(self.rows, self.order, self.weights, self.shared, pos=self.pos)
