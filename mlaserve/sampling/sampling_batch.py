"""Per-row sampling state of one forward, moved to the device once per step.

`SamplingBatch.build` is the only place that reads host lists; the `Sampler` then runs on device
tensors alone. Which optional stages run (top-k, penalties, ...) is decided here from the host-side
params, so the sampler never has to ask the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlaserve.sampling.random import to_int64
from mlaserve.sampling_params import SamplingParams

__all__ = ["SamplingBatch", "check_ids", "host_switches", "max_top_k"]


@dataclass
class SamplingBatch:
    """Row i of every [n] tensor belongs to row i of the logits."""

    vocab_size: int
    temperatures: torch.Tensor  # [n] float32; 1.0 on greedy rows, so dividing is harmless
    is_greedy: torch.Tensor  # [n] bool
    top_ks: torch.Tensor  # [n] int64; vocab_size where disabled
    top_ps: torch.Tensor  # [n] float32; 1.0 where disabled
    min_ps: torch.Tensor  # [n] float32; 0.0 where disabled
    seeds: torch.Tensor  # [n] int64; the seed's low 64 bits, two's complement
    # [n] int64; tokens the request had generated before this one (only noise reads them: a
    # `SamplingSlots` batch of greedy rows alone holds zeros)
    steps: torch.Tensor
    # Penalties; None when no row in the batch uses them.
    repetition_penalties: torch.Tensor | None  # [n] float32
    frequency_penalties: torch.Tensor | None  # [n] float32
    presence_penalties: torch.Tensor | None  # [n] float32
    prompt_mask: torch.Tensor | None = field(repr=False)  # [n, V] bool: token is in the prompt
    output_counts: torch.Tensor | None = field(repr=False)  # [n, V] float32: output occurrences
    # (row, token) pairs forced to -inf: EOS / stop ids of rows still below min_tokens.
    banned_rows: torch.Tensor | None  # [m] int64
    banned_tokens: torch.Tensor | None  # [m] int64
    # Host-side switches, decided from the params (only non-greedy rows count for the filters).
    all_greedy: bool
    any_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    # Widest top-logprobs request in the batch (K of SamplerOutput.top_ids); None if K would be 0.
    max_num_logprobs: int | None
    # Some row asks for logprobs (even 0 = the chosen token's only); without it the sampler
    # computes no log-softmax, ranks or top-k at all.
    need_logprobs: bool = True
    # Largest top_k of the sampled rows when every one of them sets one (0 < top_k < V), else
    # None. Lets the sampler take `topk(max_top_k)` instead of sorting the whole vocabulary.
    max_top_k: int | None = None
    # [n] int64 device tensor: the SamplingSlots slot of each row (None from `build`). What
    # `SamplingSlots.record` takes to count the step's tokens.
    slots: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_rows(self) -> int:
        return self.temperatures.shape[0]

    @property
    def use_penalties(self) -> bool:
        return self.repetition_penalties is not None or self.frequency_penalties is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
    ) -> SamplingBatch:
        """Gather the per-row state of `len(params)` rows.

        seeds[i] must be set even for unseeded requests (the engine draws one at intake; any
        Python int, only its low 64 bits matter). steps[i] is the number of tokens request i had
        generated before the token sampled now: the noise depends on it, and min_tokens compares
        against it. prompt_ids/output_ids are read only for rows with penalties.
        eos_token_ids: the model's EOS ids, masked (with each row's stop_token_ids) on rows with
        steps[i] < min_tokens, unless the row sets ignore_eos.
        """
        n = len(params)
        for name, seq in (
            ("seeds", seeds),
            ("steps", steps),
            ("prompt_ids", prompt_ids),
            ("output_ids", output_ids),
        ):
            if len(seq) != n:
                raise ValueError(f"{name}: expected {n} rows (one per params), got {len(seq)}")
        if n == 0:
            raise ValueError("params: a sampling batch needs at least one row")
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
        if any(s < 0 for s in steps):
            raise ValueError(f"steps: must be >= 0, got {list(steps)}")
        check_ids("eos_token_ids", eos_token_ids, vocab_size)
        device = torch.device(device)

        greedy = [p.is_greedy for p in params]
        temps, top_ks, top_ps, min_ps = [], [], [], []
        for p, g in zip(params, greedy, strict=True):
            # Filters of greedy rows are irrelevant; neutral values keep them out of the switches.
            temps.append(1.0 if g else p.temperature)
            top_ks.append(vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size))
            top_ps.append(1.0 if g else p.top_p)
            min_ps.append(0.0 if g else p.min_p)
        reps = [p.repetition_penalty for p in params]
        freqs = [p.frequency_penalty for p in params]
        presences = [p.presence_penalty for p in params]

        # Two host->device copies instead of one per field.
        floats = torch.tensor(
            [temps, top_ps, min_ps, reps, freqs, presences], dtype=torch.float32, device=device
        )
        ints = torch.tensor(
            [top_ks, [to_int64(s) for s in seeds], list(steps), greedy],
            dtype=torch.int64,
            device=device,
        )

        use_rep = any(r != 1.0 for r in reps)
        use_freq = any(f != 0.0 or p != 0.0 for f, p in zip(freqs, presences, strict=True))
        prompt_mask = output_counts = None
        if use_rep or use_freq:
            # Only rows that are penalised need their tokens on the device.
            penalised = [
                r != 1.0 or f != 0.0 or p != 0.0
                for r, f, p in zip(reps, freqs, presences, strict=True)
            ]
            output_counts = _scatter_ids(output_ids, penalised, vocab_size, device, torch.float32)
            if use_rep:
                prompt_mask = _scatter_ids(
                    prompt_ids, [r != 1.0 for r in reps], vocab_size, device, torch.bool
                )

        banned_rows = banned_tokens = None
        bans = _min_tokens_bans(params, steps, eos_token_ids, vocab_size)
        if bans:
            pairs = torch.tensor(bans, dtype=torch.int64, device=device).T  # [2, m]
            banned_rows, banned_tokens = pairs[0], pairs[1]

        return cls(
            vocab_size=vocab_size,
            temperatures=floats[0],
            is_greedy=ints[3].bool(),
            top_ks=ints[0],
            top_ps=floats[1],
            min_ps=floats[2],
            seeds=ints[1],
            steps=ints[2],
            repetition_penalties=floats[3] if use_rep else None,
            frequency_penalties=floats[4] if use_freq else None,
            presence_penalties=floats[5] if use_freq else None,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            banned_rows=banned_rows,
            banned_tokens=banned_tokens,
            **host_switches(params, vocab_size),
        )


def host_switches(params: Sequence[SamplingParams], vocab_size: int) -> dict[str, Any]:
    """The `SamplingBatch` fields decided on the host from the rows' params: which optional
    stages the sampler runs (only non-greedy rows count for the filters)."""
    greedy = [p.is_greedy for p in params]
    sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
    k = max((p.logprobs or 0 for p in params), default=0)
    return {
        "all_greedy": all(greedy),
        "any_greedy": any(greedy),
        "use_top_k": any(0 < p.top_k < vocab_size for p in sampled),
        "use_top_p": any(p.top_p < 1.0 for p in sampled),
        "use_min_p": any(p.min_p > 0.0 for p in sampled),
        "max_num_logprobs": min(k, vocab_size) or None,
        "need_logprobs": any(p.logprobs is not None for p in params),
        "max_top_k": max_top_k(sampled, vocab_size),
    }


def max_top_k(sampled: Sequence[SamplingParams], vocab_size: int) -> int | None:
    """`SamplingBatch.max_top_k` of a batch whose non-greedy rows have these params."""
    ks = [p.top_k for p in sampled]
    if not ks or not all(0 < k < vocab_size for k in ks):
        return None
    return max(ks)


def check_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    """Token ids index device tensors: refuse out-of-range ones on the host, with the field name
    (on CUDA they would surface later as an asynchronous device assert)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name}: ids must be in [0, {vocab_size}), got {bad}")


def _scatter_ids(
    rows_ids: Sequence[Sequence[int]],
    keep: list[bool],
    vocab_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[n, V] tensor: per-row token counts (float) or occurrence mask (bool) of the kept rows."""
    n = len(rows_ids)
    lengths = [len(ids) if k else 0 for ids, k in zip(rows_ids, keep, strict=True)]
    flat = list(
        itertools.chain.from_iterable(ids for ids, k in zip(rows_ids, keep, strict=True) if k)
    )
    out = torch.zeros(n, vocab_size, dtype=dtype, device=device)
    if not flat:
        return out
    tokens = torch.tensor(flat, dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(
        torch.arange(n, device=device), torch.tensor(lengths, device=device), output_size=len(flat)
    )
    if dtype == torch.bool:
        out[rows, tokens] = True
    else:
        out.index_put_((rows, tokens), torch.ones((), dtype=dtype, device=device), accumulate=True)
    return out


def _min_tokens_bans(
    params: Sequence[SamplingParams],
    steps: Sequence[int],
    eos_token_ids: Sequence[int],
    vocab_size: int,
) -> list[tuple[int, int]]:
    bans: list[tuple[int, int]] = []
    for row, (p, step) in enumerate(zip(params, steps, strict=True)):
        if step >= p.min_tokens:
            continue
        check_ids("stop_token_ids", p.stop_ids, vocab_size)
        ids = set(p.stop_ids) if p.ignore_eos else set(p.stop_ids) | set(eos_token_ids)
        bans.extend((row, t) for t in sorted(ids))
    return bans
