"""Speculative acceptance for a chain draft of k tokens per request, on the device, no host sync.

A verify forward gives the target's logits at k + 1 positions per request: row j follows the
request's tokens and draft tokens d_0 .. d_{j-1}. Per request:

- greedy: accept d_j while it is the target's argmax at row j; at the first mismatch, or after
  all k, emit the target's argmax there (the correction / bonus token).
- sampled (Leviathan et al. 2023, "Fast inference from transformers via speculative decoding";
  Chen et al. 2023, "Accelerating LLM decoding with speculative sampling"): accept d_j with
  probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a sample of
  norm(max(p_j - q_j, 0)); if all k are accepted, emit a sample of p_k. Each emitted token is
  then distributed exactly as the target's own sample would be: P(d accepted) + P(rejected) *
  residual(x) = min(p, q)(x) + (1 - sum min(p, q)) * (p - q)+(x) / sum (p - q)+ = p(x).

p_j is the distribution the plain `Sampler` draws from at that position: min_tokens bans,
penalties (counting the accepted draft tokens d_0 .. d_{j-1} as output), temperature, top-k,
top-p, min-p. q_j is the draft's distribution: a full [bs, k, V] tensor, or None for a draft
that proposes its top-1 token (a point mass: q_j(d_j) = 1, so d_j is accepted with probability
p_j(d_j) and the residual is p_j without d_j).

Randomness is the counter-based noise of `random.py`, keyed by (seed, step) with step = the
request's step + j, so a verify is reproducible per (seed, step) and needs no generator state:
the acceptance uniform of row j is column V of that stream (no token uses it), the draws are
Gumbel-max over columns 0..V-1, as in the plain sampler. The draft must therefore NOT draw its
own tokens from the same (seed, step) stream (that would correlate q's sample with the
acceptance test); a greedy draft, or one keyed by another seed, is fine.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from mlaserve.sampling.argmax_kernel import row_argmax
from mlaserve.sampling.random import gumbel_noise, uniform_noise
from mlaserve.sampling.sampler import adjust_logits, filter_logits
from mlaserve.sampling.sampling_batch import SamplingBatch

__all__ = ["AcceptOutput", "accept_draft", "target_probs"]


class AcceptOutput(NamedTuple):
    accept_len: torch.Tensor  # [bs] int64 in [1, k + 1]: accepted drafts + the one emitted token
    # [bs, k + 1] int64: the tokens to emit, valid up to accept_len. Positions past it repeat the
    # last valid token (a valid id, so the tensor can be indexed with or scattered at weight 0).
    out_tokens: torch.Tensor


class TargetDistribution(NamedTuple):
    probs: torch.Tensor | None  # [bs, k + 1, V] float32; None if every row is greedy
    argmax: torch.Tensor | None  # [bs, k + 1] int64 of the adjusted logits; None if none greedy


def target_probs(
    target_logits: torch.Tensor, draft_ids: torch.Tensor, batch: SamplingBatch
) -> TargetDistribution:
    """The target's per-position distributions, as the plain sampler would draw from them.

    target_logits: [bs, k + 1, V] (any float dtype). draft_ids: [bs, k] int64.
    batch: bs * (k + 1) rows, row b * (k + 1) + j for request b at its step + j (e.g.
    `SamplingSlots.verify_batch`); its output counts are those before the draft tokens.
    """
    bs, k1, vocab = _check_shapes(target_logits, draft_ids, batch)
    logits = target_logits.reshape(bs * k1, vocab).float()
    if batch.use_penalties and k1 > 1:
        batch = _with_draft_counts(batch, draft_ids)
    x = adjust_logits(logits, batch)
    argmax = row_argmax(x).view(bs, k1) if batch.any_greedy else None
    if batch.all_greedy:
        return TargetDistribution(None, argmax)
    f, sorted_ids = filter_logits(x, batch)
    if sorted_ids is not None:
        # Back to token order (sorted_ids may hold fewer than V columns: the rest are dropped).
        full = torch.full((bs * k1, vocab), float("-inf"), dtype=f.dtype, device=f.device)
        f = full.scatter_(1, sorted_ids, f)
    return TargetDistribution(f.softmax(dim=-1).view(bs, k1, vocab), argmax)


def accept_draft(
    target_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    batch: SamplingBatch,
    draft_probs: torch.Tensor | None = None,
) -> AcceptOutput:
    """Accept a prefix of each request's k draft tokens and emit one more token.

    target_logits: [bs, k + 1, V]. draft_ids: [bs, k] int64. batch: as in `target_probs`.
    draft_probs: [bs, k, V] float, the draft's distribution at each draft position (rows sum
    to 1), or None for a top-1 draft (point mass on draft_ids). Greedy rows ignore it.
    """
    bs, k1, vocab = _check_shapes(target_logits, draft_ids, batch)
    k = k1 - 1
    if draft_probs is not None and draft_probs.shape != (bs, k, vocab):
        raise ValueError(
            f"draft_probs: expected shape ({bs}, {k}, {vocab}), got {tuple(draft_probs.shape)}"
        )
    target = target_probs(target_logits, draft_ids, batch)
    if target.probs is None:  # every row greedy
        argmax = _required(target.argmax)
        accepted, correction = draft_ids == argmax[:, :k], argmax
    else:
        accepted, correction = _sampled(target.probs, draft_ids, draft_probs, batch)
        if target.argmax is not None:  # some rows greedy
            is_greedy = batch.is_greedy.view(bs, k1)[:, :1]
            accepted = torch.where(is_greedy, draft_ids == target.argmax[:, :k], accepted)
            correction = torch.where(is_greedy, target.argmax, correction)
    # Accepted drafts: the leading run of True.
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [bs] in [0, k]
    last = correction.gather(1, num_accepted.unsqueeze(1))  # [bs, 1]
    positions = torch.arange(k1, device=draft_ids.device)
    padded = torch.cat([draft_ids, last], dim=1)
    out_tokens = torch.where(positions < num_accepted.unsqueeze(1), padded, last)
    return AcceptOutput(num_accepted + 1, out_tokens)


def _sampled(
    probs: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    batch: SamplingBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling. probs: [bs, k + 1, V]. Returns accepted [bs, k] bool and the token
    to emit at each position if the run of acceptances stops there, [bs, k + 1] int64."""
    bs, k1, vocab = probs.shape
    k = k1 - 1
    index = draft_ids.unsqueeze(2)
    p = probs[:, :k]
    p_draft = p.gather(2, index).squeeze(2)  # [bs, k]
    if draft_probs is None:
        q = torch.zeros_like(p).scatter_(2, index, 1.0)
        q_draft = torch.ones_like(p_draft)
    else:
        q = draft_probs.float()
        q_draft = q.gather(2, index).squeeze(2)
    # Column `vocab` of each (seed, step) stream: no token's Gumbel noise uses it.
    extra = torch.full((1,), vocab, dtype=torch.int64, device=probs.device)
    u = uniform_noise(batch.seeds, batch.steps, extra).view(bs, k1)[:, :k]
    accepted = _accept(p_draft, q_draft, u)
    dist = torch.cat([_residual(p, q), probs[:, k:]], dim=1)  # [bs, k + 1, V]
    tokens = torch.arange(vocab, device=probs.device)
    noise = gumbel_noise(batch.seeds, batch.steps, tokens).view(bs, k1, vocab)
    correction = (dist.log() + noise).argmax(dim=2)
    return accepted, correction


def _accept(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """u < p / q, written without the division (q may underflow; p = q accepts surely, as
    u < 1)."""
    return u * q_draft < p_draft


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0), unnormalised (Gumbel-max does not need it). Where it is all zero
    (p <= q everywhere, so p = q and a rejection had probability 0), p itself."""
    r = (p - q).clamp_(min=0.0)
    return torch.where(r.sum(dim=-1, keepdim=True) > 0, r, p)


def _required(t: torch.Tensor | None) -> torch.Tensor:
    if t is None:
        raise RuntimeError("target_probs returned neither probs nor argmax")
    return t


def _with_draft_counts(batch: SamplingBatch, draft_ids: torch.Tensor) -> SamplingBatch:
    """Row (b, j) of a verify batch has also generated d_0 .. d_{j-1}: add them to its output
    counts (the penalties' only input that changes along the chain)."""
    counts = batch.output_counts
    if counts is None:
        return batch
    bs, k = draft_ids.shape
    k1, vocab = k + 1, counts.shape[1]
    dev = draft_ids.device
    rows = torch.arange(bs * k1, device=dev).view(bs, k1, 1)
    flat = (rows * vocab + draft_ids.unsqueeze(1)).expand(bs, k1, k)  # row (b, j), token d_i
    j = torch.arange(k1, device=dev).view(1, k1, 1)
    i = torch.arange(k, device=dev).view(1, 1, k)
    weights = (i < j).to(counts.dtype).expand(bs, k1, k)
    # scatter_add_ on the flat view of a copy: never syncs (index_put_ with accumulate may sort).
    counts = counts.clone()
    counts.view(-1).scatter_add_(0, flat.flatten(), weights.flatten())
    return dataclasses.replace(batch, output_counts=counts)


def _check_shapes(
    target_logits: torch.Tensor, draft_ids: torch.Tensor, batch: SamplingBatch
) -> tuple[int, int, int]:
    if target_logits.dim() != 3:
        raise ValueError(
            f"target_logits: expected [bs, k + 1, V], got {tuple(target_logits.shape)}"
        )
    bs, k1, vocab = target_logits.shape
    if k1 < 1 or vocab != batch.vocab_size:
        raise ValueError(
            f"target_logits: expected [bs, k + 1, {batch.vocab_size}], "
            f"got {tuple(target_logits.shape)}"
        )
    if draft_ids.shape != (bs, k1 - 1):
        raise ValueError(
            f"draft_ids: expected shape ({bs}, {k1 - 1}), got {tuple(draft_ids.shape)}"
        )
    if batch.num_rows != bs * k1:
        raise ValueError(
            f"batch: expected {bs * k1} rows (bs * (k + 1), request-major), got {batch.num_rows}"
        )
    return bs, k1, vocab
