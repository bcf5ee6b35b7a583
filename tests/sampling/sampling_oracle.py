"""Naive float64 references of the sampler's stages (penalties, the distribution a row is
sampled from) and the chi-square bound the sampling tests check their draws against."""

from __future__ import annotations

import math
from collections import Counter

import torch

from mlaserve.sampling_params import SamplingParams


def naive_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt: list[list[int]],
    output: list[list[int]],
) -> torch.Tensor:
    out = logits.double().clone()
    for i, p in enumerate(params):
        for t in set(prompt[i]) | set(output[i]):
            r = p.repetition_penalty
            out[i, t] = out[i, t] / r if out[i, t] > 0 else out[i, t] * r
        for t, count in Counter(output[i]).items():
            out[i, t] -= count * p.frequency_penalty + p.presence_penalty
    return out


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row is sampled from, computed naively in float64: [V]."""
    x = logits.double() / p.temperature
    order = x.argsort(descending=True)
    keep = torch.ones_like(x, dtype=torch.bool)
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    probs = torch.where(keep, x, -math.inf).softmax(-1)
    if p.top_p < 1.0:
        mass_before = 0.0
        for t in order.tolist():
            if mass_before >= p.top_p:
                keep[t] = False
            mass_before += probs[t].item()
        probs = torch.where(keep, x, -math.inf).softmax(-1)
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs.max()
    return torch.where(keep, x, -math.inf).softmax(-1)


def chi_square_critical(df: int, z: float = 4.753) -> float:
    """Upper quantile of chi-square(df) by Wilson-Hilferty; z = 4.753 is the 1e-6 tail."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3
