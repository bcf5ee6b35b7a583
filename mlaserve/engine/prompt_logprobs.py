"""Prompt logprobs from the prefill forward itself (no second pass), chunked prefill included.

The logits at position p predict token p + 1, so the prompt's token j (j >= 1) is scored by the
row of position j - 1; token 0 has no logprob (None, as vLLM returns it). A request that asked
(`SamplingParams.prompt_logprobs`) gets, in each EXTEND step that carries part of its prompt, one
extra logits row per prompt position of the chunk that still predicts a prompt token. Those rows
follow the step's sampling rows in `logits_indices`, so the sampler still sees its rows first
and unchanged. Requests that did not ask add nothing: no rows, no logits, no transfer; DECODE
steps (and so CUDA graphs) never carry prompt positions.

A span starts where the request's recorded prompt logprobs end, so a request recomputed after a
preemption does not score its prompt twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mlaserve.engine.request import Request
    from mlaserve.engine.scheduler import SchedulerOutput

__all__ = ["PromptLogprobSpan", "PromptLogprobs", "compute_prompt_logprobs", "plan_spans"]


@dataclass(slots=True)
class PromptLogprobSpan:
    """Prompt tokens `first_token .. first_token + len(targets) - 1` of one request, scored by
    the token rows `first_row .. first_row + len(targets) - 1` of this step's input."""

    request: Request
    first_row: int  # row in the step's flattened input_ids
    first_token: int  # index in the prompt of the first token scored (>= 1)
    targets: list[int]  # the prompt tokens scored, in order


@dataclass(slots=True)
class PromptLogprobs:
    """Host results for one span: per scored token its logprob and rank, and the top-k."""

    span: PromptLogprobSpan
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


def plan_spans(sched: SchedulerOutput) -> list[PromptLogprobSpan]:
    """The prompt positions this step scores, per request that asked (scheduling order)."""
    spans: list[PromptLogprobSpan] = []
    row = 0
    for s in sched.scheduled:
        r = s.request
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        if r.prompt_logprobs is not None:
            n = r.num_prompt_tokens
            # Next unscored prompt token: len(recorded) (token 0 is recorded as None).
            lo = max(start, len(r.prompt_logprobs) - 1)
            hi = min(end, n - 1)
            if lo < hi:
                spans.append(
                    PromptLogprobSpan(
                        request=r,
                        first_row=row + lo - start,
                        first_token=lo + 1,
                        targets=r.prompt_token_ids[lo + 1 : hi + 1],
                    )
                )
        row += s.num_new_tokens
    return spans


def compute_prompt_logprobs(
    logits: torch.Tensor, spans: list[PromptLogprobSpan]
) -> list[PromptLogprobs]:
    """logits: [sum(len(span.targets)), V] (float32 or upcast), the spans' rows in order.
    log_softmax of the raw logits, as the sampler's logprobs: target logprob, its rank
    (1 = best; ties count against it, as in the sampler) and the top-k of the widest request.
    One device->host copy (only steps with such requests pay it)."""
    logits = logits.float()
    targets = torch.tensor(
        [t for s in spans for t in s.targets], dtype=torch.int64, device=logits.device
    )
    lse = logits.logsumexp(dim=-1)
    chosen = logits.gather(1, targets.unsqueeze(1))
    ranks = (logits >= chosen).sum(dim=-1)
    logprobs = chosen.squeeze(1) - lse
    k = max(s.request.params.prompt_logprobs or 0 for s in spans)
    top_ids = top_lps = None
    if k:
        values, top_ids = logits.topk(k, dim=-1)
        top_lps = (values - lse.unsqueeze(1)).tolist()
        top_ids = top_ids.tolist()
    lp_host, rank_host = logprobs.tolist(), ranks.tolist()
    out, i = [], 0
    for s in spans:
        j = i + len(s.targets)
        out.append(
            PromptLogprobs(
                span=s,
                logprobs=lp_host[i:j],
                ranks=rank_host[i:j],
                top_ids=top_ids[i:j] if top_ids is not None else None,
                top_logprobs=top_lps[i:j] if top_lps is not None else None,
            )
        )
        i = j
    return out
