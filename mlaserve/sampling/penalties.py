"""Logit edits that depend on what a request has already seen: repetition/frequency/presence
penalties (vLLM semantics) and the min_tokens ban on EOS/stop ids."""

from __future__ import annotations

import torch

from mlaserve.sampling.sampling_batch import SamplingBatch

__all__ = ["apply_min_tokens", "apply_penalties"]


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """-inf on the EOS/stop ids of rows still below min_tokens. Returns a new tensor if any."""
    if batch.banned_rows is None or batch.banned_tokens is None:
        return logits
    neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((batch.banned_rows, batch.banned_tokens), neg_inf)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [n, V] float32. Returns a new tensor; rows without penalties are unchanged.

    - repetition (CTRL paper, as in vLLM/HF): for every token seen in the prompt OR the output,
      positive logits are divided by the penalty and negative ones multiplied, so a penalty > 1
      always makes the token less likely.
    - frequency / presence (OpenAI): logit -= count * frequency + (count > 0) * presence, over
      OUTPUT tokens only.
    """
    counts = batch.output_counts
    if batch.repetition_penalties is not None and counts is not None:
        seen = counts > 0
        if batch.prompt_mask is not None:
            seen |= batch.prompt_mask
        penalty = torch.where(seen, batch.repetition_penalties.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    freqs, presences = batch.frequency_penalties, batch.presence_penalties
    if freqs is not None and presences is not None and counts is not None:
        logits = logits - freqs.unsqueeze(1) * counts - presences.unsqueeze(1) * (counts > 0)
    return logits
