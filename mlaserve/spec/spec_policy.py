"""Whether the next decode step speculates: on only where it pays, on this hardware and model.

Step costs (`StepCosts`): per captured batch size, the wall time of three kinds of engine step,
measured at start-up in the same rounds: `spec` (verify of k+1 tokens, acceptance,
draft-extend, k draft tokens), `plain` (decode and sampling, no draft work) and `refresh` (a
plain step plus the draft's one-row cache update). While serving, each settled spec or plain
step updates its kind's cost at its size (`observe_step`) to the lower quartile of the last
`COST_WINDOW` served steps, the start-up figure counting as `STARTUP_WEIGHT` of them: timing
noise only ever adds time and comes in stretches, so the lower quartile, not the median. For
the same reason a served cost below its start-up figure means the start-up rounds ran slow, and
the other kind's start-up figure is scaled down by that factor; served plain steps above theirs
scale the spec figure up alike (the host runs slower), served spec steps above theirs scale
nothing (a dearer spec cost is what must turn speculation off). A kind's served steps expire
(its cost falls back to its scaled start-up figure) once the other kind has been observed
`EXPIRE_AFTER` times at that size since, so a slow stretch of a kind no longer served cannot
decide for good.

Accept length: `L_hat` is a prior of `PRIOR_WEIGHT` pseudo-steps at `prior_accept_length(k)`
(every position accepted with probability `PRIOR_RATE`) plus the observed accept lengths,
forgotten exponentially (half-life `HALF_LIFE` verified requests). The prior is optimistic on
purpose: one that says speculate is corrected by its own observations, one that says do not
observes nothing (plain steps verify nothing).

Decision, for `bs` requests of which `num_stale` have a stale draft cache (their drafts count as
1 token), b the smallest captured size >= bs, in this order:

    forced      `forced` is set: that decision
    cap         bs > disable_batch_size: off (refresh as below)
    unmeasured  no costs (CPU, graphs off): on
    too_large   bs past every captured size: off
    probe       a probe under way: on
    pays        L_eff > (1 + SPEC_MARGIN) * spec_s(b) / plain_s(b): on, where
                L_eff = ((bs - num_stale) * L_hat + num_stale) / bs (1 when every cache is stale)
    hold        some cache fresh, and the last decision was pays or hold at b: on, until
                `OFF_AFTER` decisions in a row have not paid
    probe       some cache fresh, and this is the `probe_interval(bs)`-th decision off in a row:
                on for `PROBE_STEPS` decisions
    does_not_pay  off; refresh iff the start-up refresh overhead at b is at most
                `REFRESH_MAX_OVERHEAD` and some cache is fresh

SPEC_MARGIN because TPOT is per request: the mean of the requests' inverse accept lengths sits
above the inverse of their mean. The hysteresis because the mistakes cost unequally: a few
speculative steps near the break-even lose little, but turning off where the refresh does not
pay stales every running request's draft cache for the rest of its life. Fresh caches are what
let speculation come back and what make a probe's observation meaningful. The probe interval is
at least `PROBE_EVERY`, and longer where the probe's extra cost would exceed `PROBE_BUDGET` of
the plain steps' time.

Decisions are counted by (speculate, reason) for the metrics. Pure host arithmetic: no device.
The measurements behind these rules: bench/RESULTS.md, "Moved from mlaserve/spec/spec_policy.py".
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "EXPIRE_AFTER",
    "FORCED_PLAIN",
    "FORCED_REFRESH",
    "FORCED_SPEC",
    "OFF_AFTER",
    "SPEC_MARGIN",
    "STEP_KINDS",
    "Decision",
    "SpecPolicy",
    "StepCosts",
    "lower_quartile",
    "prior_accept_length",
]

PRIOR_RATE = 0.8  # per-position acceptance of the prior (MTP on real text: 0.6-0.9)
PRIOR_WEIGHT = 8.0  # pseudo-steps behind the prior
HALF_LIFE = 1024  # verified requests after which an observation weighs half
PROBE_EVERY = 64  # while off by cost, probe at most once per this many decisions
PROBE_BUDGET = 0.01  # and no more often than costs this fraction of the plain steps' time
PROBE_STEPS = 2  # speculating decisions per probe: a draft step, then one verify with drafts
REFRESH_MAX_OVERHEAD = 0.02  # keep draft caches fresh while off if it costs <= 2% of a step
SPEC_MARGIN = 0.05  # speculate only where the accept length clears the break-even by this much
OFF_AFTER = 8  # speculating: turn off after this many decisions in a row that it does not pay
COST_WINDOW = 32  # served steps an online cost is the lower quartile of
EXPIRE_AFTER = 2 * COST_WINDOW  # a kind's served steps expire after this many of the other's
STARTUP_WEIGHT = 4  # served steps the start-up measurement counts as, until outvoted
STEP_KINDS = ("spec", "plain", "refresh")


def _window(seed: float, served) -> list[float]:
    """The start-up figure's STARTUP_WEIGHT copies, less those the served steps pushed out of a
    COST_WINDOW window, then the served steps (at most COST_WINDOW, newest kept)."""
    return [seed] * max(0, min(STARTUP_WEIGHT, COST_WINDOW - len(served))) + list(served)


def lower_quartile(seconds: list[float]) -> float:
    """The lower quartile of step times: noise only adds time (module doc)."""
    return sorted(seconds)[len(seconds) // 4]


def prior_accept_length(k: int, rate: float = PRIOR_RATE) -> float:
    """Expected accept length (bonus included) of a k-token chain with per-position acceptance
    `rate`: sum_{i=0..k} rate^i."""
    return sum(rate**i for i in range(k + 1))


@dataclass(frozen=True)
class StepCosts:
    """Seconds per engine step, measured per captured batch size. `refresh_s` (a plain step
    that keeps the draft caches) may be absent: caches then go stale whenever a step does not
    speculate. The batch sizes are fixed; `SpecPolicy` updates its own copy's seconds in place
    as served steps come in."""

    plain_s: dict[int, float]
    spec_s: dict[int, float]
    refresh_s: dict[int, float] | None = None
    _sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)  # sorted, once

    def __post_init__(self) -> None:
        sizes = set(self.plain_s)
        if (
            set(self.spec_s) != sizes
            or not sizes
            or (self.refresh_s is not None and set(self.refresh_s) != sizes)
        ):
            raise ValueError(
                f"StepCosts: every kind needs the same non-empty batch sizes, got plain "
                f"{sorted(self.plain_s)}, spec {sorted(self.spec_s)}"
                + (f", refresh {sorted(self.refresh_s)}" if self.refresh_s is not None else "")
            )
        tables = [self.plain_s, self.spec_s, self.refresh_s or {}]
        bad = sorted({b for t in tables for b, s in t.items() if not s > 0})
        if bad:
            raise ValueError(f"StepCosts: costs must be > 0, not at batch sizes {bad}")
        object.__setattr__(self, "_sizes", tuple(sorted(sizes)))

    def size_for(self, bs: int) -> int | None:
        """The smallest measured size >= bs (where a step of bs requests replays), or None."""
        i = bisect.bisect_left(self._sizes, bs)
        return self._sizes[i] if i < len(self._sizes) else None

    def break_even(self, bs: int) -> float | None:
        """The accept length at which speculation pays at batch size `bs` (it runs in the
        smallest measured size >= bs), or None when bs is past every measured size."""
        size = self.size_for(bs)
        return None if size is None else self.spec_s[size] / self.plain_s[size]

    def refresh_overhead(self, bs: int) -> float | None:
        """refresh / plain - 1 at bs's size; None when unmeasured or past every size."""
        size = self.size_for(bs)
        if size is None or self.refresh_s is None:
            return None
        return self.refresh_s[size] / self.plain_s[size] - 1.0


@dataclass(frozen=True)
class Decision:
    speculate: bool
    reason: str  # pays | hold | does_not_pay | probe | cap | unmeasured | too_large | forced
    # Not speculating: run the draft's cache update anyway (keeps the caches fresh).
    refresh: bool = False

    @property
    def plain(self) -> bool:
        """No draft work at all: a step of an engine without speculation."""
        return not self.speculate and not self.refresh


FORCED_SPEC = Decision(True, "forced")
FORCED_PLAIN = Decision(False, "forced")
FORCED_REFRESH = Decision(False, "forced", refresh=True)
# The steady state of a batch whose speculation does not pay: one object per refresh flag, so
# a decision costs no allocation (`SpecPolicy` decides on every decode step's host path).
_DOES_NOT_PAY = (Decision(False, "does_not_pay"), Decision(False, "does_not_pay", refresh=True))


class SpecPolicy:
    def __init__(
        self, k: int, costs: StepCosts | None = None, disable_batch_size: int | None = None
    ) -> None:
        self.k = k
        self.disable_batch_size = disable_batch_size
        self._decisions: Counter[tuple[bool, str]] = Counter()
        # What a decision is made from changes (costs, `forced`, observations): a new epoch, and
        # `repeat` no longer stands for `decide`.
        self._epoch = 0
        self._last: tuple[Decision, int] | None = None  # the last decision, its epoch
        self._repeats = 0  # `repeat`s of the last decision not yet counted in `_decisions`
        self._forced: Decision | None = None
        # Follow the served steps' wall times (`observe_step`); off where costs are given as
        # data (tests, what-if runs).
        self.follow_served_steps = True
        self._sum = 0.0  # decayed sum of observed accept lengths
        self._weight = 0.0  # decayed number of observations
        self._off_streak = 0
        self._probe_left = 0
        self._doubts = 0  # decisions in a row, while speculating by cost, that it does not pay
        # The captured size of the last decision when it speculated because it pays (or held).
        self._paying: int | None = None
        self._prior = prior_accept_length(k)  # k is fixed: computed once
        self.costs = costs

    @property
    def forced(self) -> Decision | None:
        """Set to override every decision (the start-up cost measurement, tests): FORCED_SPEC,
        FORCED_PLAIN or FORCED_REFRESH; None: the policy decides."""
        return self._forced

    @forced.setter
    def forced(self, decision: Decision | None) -> None:
        self._forced = decision
        self._epoch += 1

    @property
    def decisions(self) -> Counter[tuple[bool, str]]:
        """Decisions made, by (speculate, reason): `decide`'s and `repeat`'s."""
        self._count_repeats()
        return self._decisions

    # ----- costs: measured at start-up, then followed online -----
    @property
    def costs(self) -> StepCosts | None:
        """The current cost estimates (start-up measurement, updated by `observe_step`)."""
        return self._costs

    @costs.setter
    def costs(self, costs: StepCosts | None) -> None:
        """Start from `costs` (kept as `startup_costs`); the live copy is updated in place."""
        self.startup_costs = costs
        self._epoch += 1
        self._costs = None
        # per (kind, size): the served steps' seconds, and what the start-up figure counts as
        # (itself, or scaled with the other kind's served steps; module doc)
        self._served: dict[tuple[str, int], deque[float]] = {}
        self._seed: dict[tuple[str, int], float] = {}
        # per (kind, size): the other kind's steps observed since this kind's last one
        self._unseen: Counter[tuple[str, int]] = Counter()
        if costs is not None:
            refresh = dict(costs.refresh_s) if costs.refresh_s is not None else None
            self._costs = StepCosts(dict(costs.plain_s), dict(costs.spec_s), refresh)

    def observe_step(self, kind: str, bs: int, seconds: float) -> None:
        """The wall time of one steady-state decode step of `kind` (STEP_KINDS) with `bs`
        requests. Ignored without start-up costs or past the measured sizes, and for refresh
        steps: whether to refresh is judged by the start-up ratio alone (`_refresh_pays`), so a
        served refresh cost would drive nothing."""
        self.observe_steps(kind, bs, (seconds,))

    def observe_steps(self, kind: str, bs: int, seconds: Iterable[float]) -> None:
        """`observe_step` for several steps of one kind and size, oldest first."""
        if kind not in STEP_KINDS:
            raise ValueError(f"observe_step: kind must be one of {STEP_KINDS}, got {kind!r}")
        costs = self._costs
        if costs is None or kind == "refresh" or not self.follow_served_steps:
            return
        size = costs.size_for(bs)
        if size is None:
            return
        served = self._served.get((kind, size))
        if served is None:
            served = self._served[(kind, size)] = deque(maxlen=COST_WINDOW)
        new = [s for s in seconds if s > 0]
        served.extend(new)
        other = "spec" if kind == "plain" else "plain"
        self._unseen[(kind, size)] = 0
        self._unseen[(other, size)] += len(new)
        stale = self._served.get((other, size))
        expired = bool(stale) and self._unseen[(other, size)] >= EXPIRE_AFTER
        if expired:
            stale.clear()  # (module doc: an unobserved kind's slow stretch must not stay)
        changed = self._update(kind, size)
        # A served cost below the start-up figure means the start-up rounds ran slow by that
        # factor (noise only adds time): the other kind's figure, measured in the same rounds,
        # counts as scaled down alike. Plain steps above theirs scale the speculative figure up
        # alike (the host runs slower); speculative ones above theirs do not (module doc).
        startup = self._startup(kind, size)
        own = lower_quartile(_window(startup, served))  # this kind's own evidence alone
        factor = own / startup if kind == "plain" else min(1.0, own / startup)
        seed = self._startup(other, size) * factor
        if expired or seed != self._seed.get((other, size)):  # the other's window changed
            self._seed[(other, size)] = seed
            changed |= self._update(other, size)
        if changed:
            self._epoch += 1

    def _startup(self, kind: str, size: int) -> float:
        startup = self.startup_costs
        return (startup.plain_s if kind == "plain" else startup.spec_s)[size]

    def _update(self, kind: str, size: int) -> bool:
        """Recompute the live cost of `kind` at `size` -> whether it changed."""
        table = self._costs.plain_s if kind == "plain" else self._costs.spec_s
        cost = lower_quartile(self.cost_window(kind, size))
        if cost == table[size]:
            return False
        table[size] = cost
        return True

    def cost_window(self, kind: str, bs: int) -> list[float]:
        """The seconds the current `kind` cost at bs's size is the lower quartile of: the
        start-up figure (`STARTUP_WEIGHT` times, until pushed out; scaled as the other kind's
        served steps moved theirs: down for either kind, up for the speculative figure only)
        and the served steps since, oldest first."""
        size = self._costs.size_for(bs) if self._costs is not None else None
        if size is None:
            return []
        seed = self._seed.get((kind, size), self._startup(kind, size))
        return _window(seed, self._served.get((kind, size), ()))

    def served_steps(self, kind: str, bs: int) -> list[float]:
        """The served steps' seconds in `kind`'s window at bs's size, oldest first."""
        size = self._costs.size_for(bs) if self._costs is not None else None
        return list(self._served.get((kind, size), ()))

    # ----- accept length -----
    @property
    def prior(self) -> float:
        return self._prior

    @property
    def accept_length_estimate(self) -> float:
        return (PRIOR_WEIGHT * self.prior + self._sum) / (PRIOR_WEIGHT + self._weight)

    def reset_observations(self) -> None:
        """Back to the prior: no accept lengths observed, no probe under way."""
        self._count_repeats()
        self._sum = self._weight = 0.0
        self._off_streak = self._probe_left = self._doubts = 0
        self._paying = None
        self._epoch += 1

    def observe(self, accept_lens: list[int]) -> None:
        """Accept lengths (1..k+1) of requests one speculative step verified (fresh caches)."""
        decay = 0.5 ** (1.0 / HALF_LIFE)
        for n in accept_lens:
            self._sum = self._sum * decay + n
            self._weight = self._weight * decay + 1.0
        if accept_lens:
            self._epoch += 1

    # ----- the decision -----
    def decide(self, bs: int, num_stale: int = 0) -> Decision:
        """Whether a decode step of `bs` requests, `num_stale` of them with stale draft caches,
        speculates (counted)."""
        self._count_repeats()
        d = self._decide(bs, num_stale)
        self._decisions[(d.speculate, d.reason)] += 1
        self._off_streak = 0 if d.speculate else self._off_streak + 1
        # (pays and hold need measured costs)
        self._paying = self._costs.size_for(bs) if d.reason in ("pays", "hold") else None
        if d.reason != "hold":
            self._doubts = 0
        # Only a plain decision for a batch whose every cache is stale repeats as it was made
        # (with a fresh cache a decision off also counts towards the next probe).
        self._last = (d, self._epoch) if d.plain and num_stale >= bs else None
        return d

    def repeat(self) -> Decision | None:
        """`decide` again with the arguments of the last call, when its batch had every cache
        stale, its decision was plain (no draft work) and nothing it was made from has changed
        since (costs, observations, `forced`): that decision (counted), else None. Spares a plain
        step of an unchanged batch `decide`'s host work, which on a small model is a step's time."""
        last = self._last
        if last is None or last[1] != self._epoch:
            return None
        self._repeats += 1
        return last[0]

    def _count_repeats(self) -> None:
        """Count the repeated decisions: plain ones, each another decision off."""
        if self._repeats:
            d = self._last[0]
            self._decisions[(d.speculate, d.reason)] += self._repeats
            self._off_streak += self._repeats
            self._repeats = 0

    def _decide(self, bs: int, num_stale: int) -> Decision:
        if self.forced is not None:
            return self.forced
        if self.disable_batch_size is not None and bs > self.disable_batch_size:
            self._probe_left = 0
            return Decision(False, "cap", refresh=self._refresh_pays(bs, num_stale))
        if self._costs is None:
            return Decision(True, "unmeasured")
        break_even = self._costs.break_even(bs)
        if break_even is None:
            self._probe_left = 0
            return Decision(False, "too_large")  # eager steps: no measurement to go by
        if self._probe_left > 0:
            self._probe_left -= 1
            return Decision(True, "probe")
        fresh = bs - min(num_stale, bs)
        # (every cache stale: a step emits one token whatever the estimate says)
        effective = (fresh * self.accept_length_estimate + (bs - fresh)) / bs if fresh else 1.0
        if effective > (1.0 + SPEC_MARGIN) * break_even:
            return Decision(True, "pays")
        if fresh:
            held = self._paying == self._costs.size_for(bs)
            if held and self._doubts + 1 < OFF_AFTER:
                self._doubts += 1
                return Decision(True, "hold")
            if self._off_streak + 1 >= self.probe_interval(bs):
                self._probe_left = PROBE_STEPS - 1
                return Decision(True, "probe")
        return _DOES_NOT_PAY[self._refresh_pays(bs, num_stale)]

    def probe_interval(self, bs: int) -> int:
        """Plain decisions between probes at `bs`: PROBE_EVERY, or more where a probe's extra
        cost (PROBE_STEPS speculative steps instead of plain ones) would exceed PROBE_BUDGET."""
        break_even = self._costs.break_even(bs) if self._costs is not None else None
        if break_even is None:
            return PROBE_EVERY
        return max(PROBE_EVERY, math.ceil(PROBE_STEPS * (break_even - 1.0) / PROBE_BUDGET))

    def _refresh_pays(self, bs: int, num_stale: int) -> bool:
        """Cheap enough, and some cache is still whole (a refresh cannot mend a stale one)."""
        if num_stale >= bs:
            return False
        startup = self.startup_costs
        overhead = startup.refresh_overhead(bs) if startup is not None else None
        return overhead is not None and overhead <= REFRESH_MAX_OVERHEAD
