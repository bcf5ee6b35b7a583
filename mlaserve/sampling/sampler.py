"""Batched next-token sampling on device, without host syncs.

Pipeline, per row (each stage runs only if some row in the batch needs it):

    raw logits ─┬─> log-probs reported to the user (log_softmax of the RAW logits)
                └─> min_tokens ban -> penalties ─┬─> argmax                      (greedy rows)
                                                 └─> / temperature -> top-k -> top-p -> min-p
                                                     -> argmax(logits + gumbel(seed, step, id))

Reported log-probs are vLLM's default "raw logprobs": the model's own distribution, before
penalties, temperature and filtering, so they do not depend on the sampling settings. The
rank of a token is vLLM's: the number of tokens whose log-prob is >= its own (1 = most likely).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mlaserve.sampling.penalties import apply_min_tokens, apply_penalties
from mlaserve.sampling.random import gumbel_noise
from mlaserve.sampling.sampling_batch import SamplingBatch

__all__ = ["Sampler", "SamplerOutput"]


class SamplerOutput(NamedTuple):
    token_ids: torch.Tensor  # [n] int64
    logprobs: torch.Tensor  # [n] float32, raw log-prob of the chosen token
    ranks: torch.Tensor  # [n] int64, rank of the chosen token under the raw logits (1 = best)
    # K = batch.max_num_logprobs (the widest request; narrower rows slice [:k]). None if K is 0.
    top_ids: torch.Tensor | None  # [n, K] int64, best first
    top_logprobs: torch.Tensor | None  # [n, K] float32
    # [n] bool: every raw logit of the row is finite. A NaN/inf row (a numerical fault upstream)
    # samples garbage; the caller turns it into a per-request error. Computed on device and
    # meant to travel to the host in the same copy as token_ids: no extra sync.
    finite: torch.Tensor | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [n, V] (float32; other float dtypes are upcast). Returns one token per row."""
        if logits.dim() != 2 or logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(
                f"logits: expected shape ({batch.num_rows}, {batch.vocab_size}), "
                f"got {tuple(logits.shape)}"
            )
        logits = logits.float()
        finite = torch.isfinite(logits).all(dim=-1)
        x = apply_min_tokens(logits, batch)
        if batch.use_penalties:
            x = apply_penalties(x, batch)
        if batch.all_greedy:
            token_ids = x.argmax(dim=-1)
        else:
            token_ids = sample(x, batch)
            if batch.any_greedy:
                token_ids = torch.where(batch.is_greedy, x.argmax(dim=-1), token_ids)
        return _raw_logprobs(logits, token_ids, batch.max_num_logprobs)._replace(finite=finite)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row. logits: [n, V] float32 after
    penalties. Returns [n] int64. Greedy rows get an arbitrary token (the caller overrides them)."""
    x = logits / batch.temperatures.unsqueeze(1)
    vocab_size = x.shape[1]
    positions = torch.arange(vocab_size, device=x.device)
    sorted_ids: torch.Tensor | None = None
    if batch.use_top_k or batch.use_top_p:
        # Work in sorted order (best first): top-k is then a position cut and top-p a cumsum.
        x, sorted_ids = x.sort(dim=-1, descending=True)
        if batch.use_top_k:
            # Exactly k survive; ties at the k-th logit are broken by sort order.
            x = x.masked_fill(positions >= batch.top_ks.unsqueeze(1), -math.inf)
        if batch.use_top_p:
            probs = x.softmax(dim=-1)  # renormalised over the top-k survivors
            mass_before = probs.cumsum(dim=-1) - probs
            # Keep the smallest prefix whose mass reaches p: drop a token once the tokens before
            # it already hold p. The first token always survives (mass_before = 0 < p).
            # NOTE: `top_p < 1` keeps p = 1 an exact no-op despite cumsum rounding.
            top_ps = batch.top_ps.unsqueeze(1)
            x = x.masked_fill((mass_before >= top_ps) & (top_ps < 1.0), -math.inf)
        row_max = x[:, :1]
    else:
        row_max = x.amax(dim=-1, keepdim=True)
    if batch.use_min_p:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed, and the
        # ratio is the same before or after top-k/top-p renormalisation. log(0) = -inf keeps all.
        x = x.masked_fill(x < row_max + batch.min_ps.log().unsqueeze(1), -math.inf)
    # The noise follows the token id, not the column, so sorting does not change the draw.
    token_ids = positions if sorted_ids is None else sorted_ids
    best = (x + gumbel_noise(batch.seeds, batch.steps, token_ids)).argmax(dim=-1)
    if sorted_ids is None:
        return best
    return sorted_ids.gather(1, best.unsqueeze(1)).squeeze(1)


def _raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int | None) -> SamplerOutput:
    # logit - logsumexp == log_softmax, without materialising the [n, V] log-probs.
    lse = logits.logsumexp(dim=-1)
    chosen = logits.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = (logits >= chosen).sum(dim=-1)
    top_ids = top_logprobs = None
    if k:
        top_values, top_ids = logits.topk(k, dim=-1)
        top_logprobs = top_values - lse.unsqueeze(1)
    return SamplerOutput(token_ids, chosen.squeeze(1) - lse, ranks, top_ids, top_logprobs)
