"""Whether the next decode step speculates: on only where it pays, on this hardware and model.

At start-up the engine measures, per captured batch size, the wall time of one speculative step
(verify of k+1 tokens, acceptance, draft-extend, k draft tokens; all graphed) and of one plain
step (decode, sampling, the draft's one-row cache update) -> `StepCosts`. A speculative step
emits L tokens per request on average (the accept length, bonus included), a plain one 1, so
speculation pays at batch size b iff

    L_hat > spec_s(b) / plain_s(b)          (the break-even accept length)

L_hat is a running estimate of the accept length: a prior of `PRIOR_WEIGHT` pseudo-steps at the
accept length of a chain whose every position is accepted with probability `PRIOR_RATE`
(1 + p + ... + p^k: 2.18 for p = 0.6, k = 3), plus the observed lengths with exponential forgetting
(weight halves every `HALF_LIFE` verified requests), so it follows a change of traffic.

A step that does not speculate observes nothing, so while speculation does not pay, every
`PROBE_EVERY`-th decision speculates anyway (reason "probe") to keep the estimate current.
`disable_batch_size` is a hard cap: above it, never (reason "cap"). Without measured costs (CPU,
graphs off) speculation is always on below the cap (reason "unmeasured").

Decisions are counted by (speculate, reason) for the metrics. Pure host arithmetic: no device.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Decision", "SpecPolicy", "StepCosts", "prior_accept_length"]

PRIOR_RATE = 0.6  # per-position acceptance of the prior (MTP on real text: 0.6-0.9)
PRIOR_WEIGHT = 8.0  # pseudo-steps behind the prior
HALF_LIFE = 1024  # verified requests after which an observation weighs half
PROBE_EVERY = 64  # while off by cost, speculate once per this many decisions


def prior_accept_length(k: int, rate: float = PRIOR_RATE) -> float:
    """Expected accept length (bonus included) of a k-token chain with per-position acceptance
    `rate`: sum_{i=0..k} rate^i."""
    return sum(rate**i for i in range(k + 1))


@dataclass(frozen=True)
class StepCosts:
    """Seconds per step, measured per captured batch size (keys sorted on lookup)."""

    plain_s: dict[int, float]
    spec_s: dict[int, float]

    def __post_init__(self) -> None:
        if set(self.plain_s) != set(self.spec_s) or not self.plain_s:
            raise ValueError(
                f"StepCosts: plain and speculative costs need the same non-empty batch sizes, "
                f"got {sorted(self.plain_s)} and {sorted(self.spec_s)}"
            )
        bad = [b for b in self.plain_s if self.plain_s[b] <= 0 or self.spec_s[b] <= 0]
        if bad:
            raise ValueError(f"StepCosts: costs must be > 0, not at batch sizes {bad}")

    def break_even(self, bs: int) -> float | None:
        """The accept length at which speculation pays at batch size `bs` (it runs in the
        smallest measured size >= bs), or None when bs is past every measured size."""
        sizes = sorted(self.plain_s)
        i = bisect.bisect_left(sizes, bs)
        if i == len(sizes):
            return None
        size = sizes[i]
        return self.spec_s[size] / self.plain_s[size]


@dataclass(frozen=True)
class Decision:
    speculate: bool
    reason: str  # pays | does_not_pay | probe | cap | unmeasured | too_large


@dataclass
class SpecPolicy:
    k: int
    costs: StepCosts | None = None
    disable_batch_size: int | None = None
    decisions: Counter[tuple[bool, str]] = field(default_factory=Counter)
    _sum: float = 0.0  # decayed sum of observed accept lengths
    _weight: float = 0.0  # decayed number of observations
    _off_streak: int = 0
    # Set (True/False) to override every decision (the start-up cost measurement does).
    forced: bool | None = None

    @property
    def prior(self) -> float:
        return prior_accept_length(self.k)

    @property
    def accept_length_estimate(self) -> float:
        return (PRIOR_WEIGHT * self.prior + self._sum) / (PRIOR_WEIGHT + self._weight)

    def observe(self, accept_lens: list[int]) -> None:
        """Accept lengths (1..k+1) of the requests one speculative step verified."""
        decay = 0.5 ** (1.0 / HALF_LIFE)
        for n in accept_lens:
            self._sum = self._sum * decay + n
            self._weight = self._weight * decay + 1.0

    def decide(self, bs: int) -> Decision:
        """Whether a decode step of `bs` requests speculates (counted)."""
        d = self._decide(bs)
        self.decisions[(d.speculate, d.reason)] += 1
        self._off_streak = 0 if d.speculate else self._off_streak + 1
        return d

    def _decide(self, bs: int) -> Decision:
        if self.forced is not None:
            return Decision(self.forced, "forced")
        if self.disable_batch_size is not None and bs > self.disable_batch_size:
            return Decision(False, "cap")
        if self.costs is None:
            return Decision(True, "unmeasured")
        break_even = self.costs.break_even(bs)
        if break_even is None:
            return Decision(False, "too_large")  # eager steps: no measurement to go by
        if self.accept_length_estimate > break_even:
            return Decision(True, "pays")
        if self._off_streak + 1 >= PROBE_EVERY:
            return Decision(True, "probe")
        return Decision(False, "does_not_pay")
