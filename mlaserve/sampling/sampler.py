"""Batched next-token sampling on device, without host syncs.

Pipeline, per row (each stage runs only if some row in the batch needs it):

    raw logits ─┬─> log-probs reported to the user (log_softmax of the RAW logits)
                └─> min_tokens ban -> penalties ─┬─> argmax                      (greedy rows)
                                                 └─> / temperature -> top-k -> top-p -> min-p
                                                     -> argmax(logits + gumbel(seed, step, id))

An all-greedy batch in which nobody asks for logprobs and no row is below min_tokens costs
one argmax (no upcast of float32 logits, no log-softmax, no ranks): on CUDA the two kernels of
`argmax_kernel.py`, which also give the finite check; elsewhere torch's argmax. A DECODE CUDA
graph runs those kernels itself, on its static logits (`greedy_rows`), and hands their outputs
over as `GreedyRows`: such a batch then launches nothing here. On a small model a decode step
is host-bound, and the two Triton launches, their four buffers and the read-back's `where`
were a large share of its host time (bench/RESULTS.md, "Moved from
mlaserve/sampling/sampler.py").

Reported log-probs are vLLM's default "raw logprobs": the model's own distribution, before
penalties, temperature and filtering, so they do not depend on the sampling settings. The
rank of a token is vLLM's: the number of tokens whose log-prob is >= its own (1 = most likely).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from mlaserve.sampling.argmax_kernel import argmax_available, fused_argmax
from mlaserve.sampling.penalties import apply_min_tokens, apply_penalties
from mlaserve.sampling.random import gumbel_argmax
from mlaserve.sampling.sampling_batch import SamplingBatch

# Up to this k, `topk` is cheaper than sorting a 100k+ vocabulary.
TOPK_INSTEAD_OF_SORT = 1024

__all__ = [
    "GreedyRows",
    "Sampler",
    "SamplerOutput",
    "adjust_logits",
    "filter_logits",
    "finite_rows",
    "greedy_rows",
    "raw_logprobs",
    "sample",
]


class SamplerOutput(NamedTuple):
    token_ids: torch.Tensor  # [n] int64
    # logprobs / ranks: None unless some row asks for logprobs (batch.need_logprobs).
    logprobs: torch.Tensor | None  # [n] float32, raw log-prob of the chosen token
    ranks: (
        torch.Tensor | None
    )  # [n] int64, rank of the chosen token under the raw logits (1 = best)
    # K = batch.max_num_logprobs (the widest request; narrower rows slice [:k]). None if K is 0.
    top_ids: torch.Tensor | None  # [n, K] int64, best first
    top_logprobs: torch.Tensor | None  # [n, K] float32
    # [n] bool: every raw logit of the row is finite. A NaN/inf row (a numerical fault upstream)
    # samples garbage; the caller turns it into a per-request error. Computed on device and
    # meant to travel to the host in the same copy as token_ids: no extra sync.
    finite: torch.Tensor | None = None


class GreedyRows(NamedTuple):
    """Greedy sampling of float32 logits rows, done where the logits were made (inside the
    CUDA graph whose static output they are, by `greedy_rows`). What `Sampler` returns for an
    all-greedy batch whose logits need no adjustment, without launching anything."""

    token_ids: torch.Tensor  # [n] int64: the argmax of each row (in the vocabulary even on
    # a non-finite row: a next forward may read it as its input id)
    finite: torch.Tensor  # [n] bool: every logit of the row is finite
    read: torch.Tensor  # [n] int64: token_ids, -1 where not finite (what the host reads back)

    def head(self, n: int) -> GreedyRows:
        """The first n rows (a graph's static outputs cover its padded rows too)."""
        return GreedyRows(self.token_ids[:n], self.finite[:n], self.read[:n])


def greedy_rows(logits: torch.Tensor) -> GreedyRows | None:
    """`GreedyRows` of logits [n, V] float32, from the fused argmax; None where that does not
    run (not CUDA: the sampler's own argmax is as cheap as anything done ahead there).
    Graph-capturable: no host reads."""
    if logits.dtype != torch.float32 or not argmax_available(logits.device):
        return None
    token_ids, finite = fused_argmax(logits)
    return GreedyRows(token_ids, finite, torch.where(finite, token_ids, -1))


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        token_mask: Callable[[torch.Tensor], None] | None = None,
        greedy: GreedyRows | None = None,
    ) -> SamplerOutput:
        """logits: [n, V] (float32; other float dtypes are upcast). Returns one token per row.
        `token_mask` (structured output) sets disallowed logits to -inf in place, after the
        penalties; the finite check and the logprobs still read the raw logits. `greedy`: the
        argmax of these very rows, computed ahead (`greedy_rows`); taken when the batch is all
        greedy and nothing adjusts its logits, so the token ids returned are then its tensors."""
        if logits.dim() != 2 or logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(
                f"logits: expected shape ({batch.num_rows}, {batch.vocab_size}), "
                f"got {tuple(logits.shape)}"
            )
        if greedy is not None and greedy.token_ids.shape[0] != batch.num_rows:
            raise ValueError(
                f"greedy: {greedy.token_ids.shape[0]} rows computed ahead for a batch of "
                f"{batch.num_rows}"
            )
        logits = logits.float()
        x = adjust_logits(logits, batch)
        if token_mask is not None:
            if x is logits:
                x = x.clone()
            token_mask(x)
        if batch.all_greedy and x is logits and greedy is not None:
            token_ids, finite = greedy.token_ids, greedy.finite
        elif batch.all_greedy and x is logits and argmax_available(x.device):
            # unadjusted logits: the kernel's finite flag is finite_rows' answer
            token_ids, finite = fused_argmax(x)
        else:
            if batch.all_greedy:
                token_ids = x.argmax(dim=-1)
            else:
                token_ids = sample(x, batch)
                if batch.any_greedy:
                    token_ids = torch.where(batch.is_greedy, x.argmax(dim=-1), token_ids)
            finite = finite_rows(logits, token_ids, batch.all_greedy)
        if not batch.need_logprobs:
            return SamplerOutput(token_ids, None, None, None, None, finite)
        return raw_logprobs(logits, token_ids, batch.max_num_logprobs)._replace(finite=finite)


def finite_rows(logits: torch.Tensor, token_ids: torch.Tensor, all_greedy: bool) -> torch.Tensor:
    """[n] bool: the row's logits are all finite (NaN/inf become a per-request error, never a
    token). Greedy batches need no extra pass over [n, V]: argmax propagates NaN (and picks
    +inf), so the chosen logit is finite exactly when the row is (an all -inf row too)."""
    if all_greedy:
        return torch.isfinite(logits.gather(1, token_ids.unsqueeze(1)).squeeze(1))
    return torch.isfinite(logits).all(dim=-1)


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The stages every row goes through, greedy or not: min_tokens ban, then penalties.
    logits: [n, V] float32. Returns the same tensor when neither stage applies."""
    x = apply_min_tokens(logits, batch)
    if batch.use_penalties:
        x = apply_penalties(x, batch)
    return x


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row. logits: [n, V] float32 after
    penalties. Returns [n] int64. Greedy rows get an arbitrary token (the caller overrides them)."""
    x, sorted_ids = filter_logits(logits, batch)
    # The noise follows the token id, not the column, so sorting does not change the draw.
    best = gumbel_argmax(x, batch.seeds, batch.steps, sorted_ids)
    if sorted_ids is None:
        return best
    return sorted_ids.gather(1, best.unsqueeze(1)).squeeze(1)


def filter_logits(
    logits: torch.Tensor, batch: SamplingBatch
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, top-k, top-p, min-p. logits: [n, V] float32 after penalties.

    Returns (x, sorted_ids): x [n, C] float32 is the scaled logits with -inf on every dropped
    token; softmax(x) is the distribution a row is sampled from. When sorted_ids ([n, C] int64)
    is not None, x is in sorted order (best first) and column c of row i stands for token
    sorted_ids[i, c]; C is V, or batch.max_top_k when every sampled row has a small top-k (the
    tokens past it are dropped anyway). When sorted_ids is None, C = V and column c is token c.
    """
    x = logits / batch.temperatures.unsqueeze(1)
    sorted_ids: torch.Tensor | None = None
    if batch.use_top_k or batch.use_top_p:
        # Work in sorted order (best first): top-k is then a position cut and top-p a cumsum.
        if batch.max_top_k is not None and batch.max_top_k <= TOPK_INSTEAD_OF_SORT:
            # Every sampled row keeps at most max_top_k tokens: the rest can never be drawn,
            # so only those columns are kept (top-p then renormalises over them, as it does
            # after the cut below). A partial top-k instead of a full sort of V, and the
            # noise and softmax run over max_top_k columns, not V.
            x, sorted_ids = x.topk(batch.max_top_k, dim=-1)
        else:
            x, sorted_ids = x.sort(dim=-1, descending=True)
        if batch.use_top_k:
            positions = torch.arange(x.shape[1], device=x.device)
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
    if batch.use_min_p:
        # Sorted: the best logit is column 0; otherwise one reduction (only min-p needs it).
        row_max = x[:, :1] if sorted_ids is not None else x.amax(dim=-1, keepdim=True)
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed, and the
        # ratio is the same before or after top-k/top-p renormalisation. log(0) = -inf keeps all.
        x = x.masked_fill(x < row_max + batch.min_ps.log().unsqueeze(1), -math.inf)
    return x, sorted_ids


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int | None) -> SamplerOutput:
    """Raw log-probs, ranks and the top-k of chosen tokens. logits [n, V] float32, token_ids
    [n] int64 (also used by speculative decoding for the tokens a verify emits)."""
    # logit - logsumexp == log_softmax, without materialising the [n, V] log-probs.
    lse = logits.logsumexp(dim=-1)
    chosen = logits.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = (logits >= chosen).sum(dim=-1)
    top_ids = top_logprobs = None
    if k:
        top_values, top_ids = logits.topk(k, dim=-1)
        top_logprobs = top_values - lse.unsqueeze(1)
    return SamplerOutput(token_ids, chosen.squeeze(1) - lse, ranks, top_ids, top_logprobs)
