"""The speculation policy's decisions from measured step costs (given here as data: seconds per
step per batch size, shaped like an H100 measurement) and observed accept lengths."""

from __future__ import annotations

import math

import pytest

from mlaserve.spec.spec_policy import (
    COST_WINDOW,
    EXPIRE_AFTER,
    FORCED_PLAIN,
    FORCED_REFRESH,
    FORCED_SPEC,
    HALF_LIFE,
    OFF_AFTER,
    PROBE_BUDGET,
    PROBE_EVERY,
    PROBE_STEPS,
    SPEC_MARGIN,
    STARTUP_WEIGHT,
    SpecPolicy,
    StepCosts,
    prior_accept_length,
)

K = 3
# Plain steps cost ~flat in bs (weight reads), speculative ones grow: break-even 1.2 at bs 1,
# 1.6 at 4, 2.4 at 16, 3.2 at 32.
COSTS = StepCosts(
    plain_s={1: 5e-3, 4: 5.5e-3, 16: 6e-3, 32: 7e-3},
    spec_s={1: 6e-3, 4: 8.8e-3, 16: 14.4e-3, 32: 22.4e-3},
)


def test_prior_accept_length() -> None:
    assert prior_accept_length(3, 0.6) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    assert prior_accept_length(1, 0.0) == 1.0
    assert SpecPolicy(K).accept_length_estimate == pytest.approx(prior_accept_length(K))


def test_break_even_uses_the_padded_size() -> None:
    assert COSTS.break_even(1) == pytest.approx(1.2)
    assert COSTS.break_even(3) == pytest.approx(1.6)  # replays in the size-4 graphs
    assert COSTS.break_even(17) == pytest.approx(3.2)
    assert COSTS.break_even(33) is None


@pytest.mark.parametrize(
    ("plain", "spec", "match"),
    [
        ({1: 1.0}, {2: 1.0}, "same non-empty batch sizes"),
        ({}, {}, "same non-empty batch sizes"),
        ({1: 0.0}, {1: 1.0}, "must be > 0"),
    ],
)
def test_costs_are_validated(plain, spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        StepCosts(plain_s=plain, spec_s=spec)


def test_refresh_costs_are_validated() -> None:
    with pytest.raises(ValueError, match="refresh"):
        StepCosts(plain_s={1: 1.0}, spec_s={1: 1.0}, refresh_s={2: 1.0})
    with pytest.raises(ValueError, match="must be > 0"):
        StepCosts(plain_s={1: 1.0}, spec_s={1: 1.0}, refresh_s={1: -1.0})


def test_prior_decides_before_any_observation() -> None:
    policy = SpecPolicy(K, COSTS)  # prior 2.95: pays below break-even 2.95 / 1.05
    assert [policy.decide(bs).speculate for bs in (1, 4, 16, 32)] == [True, True, True, False]
    assert policy.decisions[(True, "pays")] == 3
    assert policy.decisions[(False, "does_not_pay")] == 1


def test_observed_accept_lengths_move_the_decision() -> None:
    policy = SpecPolicy(K, COSTS)
    policy.observe([4] * 200)  # every draft accepted
    assert policy.accept_length_estimate > 3.8
    assert all(policy.decide(bs).speculate for bs in (1, 4, 16, 32))
    policy.observe([1] * 20 * HALF_LIFE)  # nothing accepted any more: the past fades
    assert policy.accept_length_estimate < 1.1
    assert [policy.decide(bs).reason for bs in (1, 32)] == ["does_not_pay"] * 2


def test_probe_while_off() -> None:
    """After probe_interval decisions off, a probe of PROBE_STEPS speculating decisions (a draft
    step, then one verify that drafts again: one steady-state speculative step). The interval
    keeps the probes within PROBE_BUDGET of the plain steps' time, and is at least PROBE_EVERY."""
    policy = SpecPolicy(K, COSTS)
    policy.observe([1] * 1000)
    every = policy.probe_interval(16)  # break-even 2.4: 2 x 1.4 / 1% = 280 decisions
    assert every == math.ceil(PROBE_STEPS * 1.4 / PROBE_BUDGET)
    assert policy.probe_interval(1) == PROBE_EVERY  # break-even 1.2: 40 -> at least 64
    reasons = [policy.decide(16).reason for _ in range(2 * every + 2 * PROBE_STEPS)]
    assert reasons.count("probe") == 2 * PROBE_STEPS
    first = every - 1
    assert reasons[first : first + PROBE_STEPS] == ["probe"] * PROBE_STEPS
    second = first + PROBE_STEPS + every - 1  # every - 1 decisions off, then the next probe
    assert reasons[second : second + PROBE_STEPS] == ["probe"] * PROBE_STEPS


def test_no_probe_when_every_cache_is_stale() -> None:
    """A probe observes only requests whose draft cache is whole; with none, it would cost
    speculative steps and learn nothing."""
    policy = SpecPolicy(K, COSTS)
    policy.observe([1] * 1000)
    assert all(policy.decide(16, num_stale=16).reason == "does_not_pay" for _ in range(300))
    assert policy.decide(16, num_stale=15).reason == "probe"  # one fresh request: worth it


def test_stale_caches_count_as_one_token() -> None:
    """L_eff = (fresh * L_hat + stale) / bs against the break-even (1.6 at bs 4)."""
    policy = SpecPolicy(K, COSTS)
    policy.observe([4] * 2000)  # L_hat ~ 4
    assert policy.decide(4, num_stale=0).speculate  # 4 > 1.6
    assert policy.decide(4, num_stale=3).speculate  # (4 + 3) / 4 = 1.75 > 1.6
    d = policy.decide(4, num_stale=4)  # 1.0 < 1.6
    assert not d.speculate and d.reason == "does_not_pay"


def test_online_costs_follow_the_served_steps() -> None:
    """Start-up said speculation pays at bs 1 (break-even 1.2 < prior 2.18); the served
    speculative steps cost 3x the plain ones, so the live break-even moves to ~3 and the
    decision turns; `startup_costs` keeps the measurement."""
    policy = SpecPolicy(K, COSTS)
    assert policy.decide(1).speculate
    for _ in range(400):
        policy.observe_step("spec", 1, 15e-3)
        policy.observe_step("plain", 1, 5e-3)
    assert policy.costs.break_even(1) == pytest.approx(3.0, rel=0.02)
    assert policy.startup_costs.break_even(1) == pytest.approx(1.2)
    assert policy.costs.break_even(4) == pytest.approx(1.6)  # other sizes untouched
    reasons = [policy.decide(1).reason for _ in range(OFF_AFTER)]
    assert reasons == ["hold"] * (OFF_AFTER - 1) + ["does_not_pay"]


def test_a_wrong_startup_cost_is_outvoted_within_a_few_steps() -> None:
    """The start-up figure counts as STARTUP_WEIGHT steps of the window, whose lower quartile is
    the cost: one too low is outvoted by 3 * STARTUP_WEIGHT served steps, one too high by 2."""
    policy = SpecPolicy(K, COSTS)  # start-up: spec 6 ms, plain 5 ms at bs 1 (break-even 1.2)
    assert policy.decide(1).speculate
    for _ in range(3 * STARTUP_WEIGHT - 1):
        policy.observe_step("spec", 1, 25e-3)  # what serving really costs
        assert policy.costs.spec_s[1] == pytest.approx(6e-3)
    policy.observe_step("spec", 1, 25e-3)
    assert policy.costs.spec_s[1] == pytest.approx(25e-3)
    assert [policy.decide(1).reason for _ in range(OFF_AFTER)][-1] == "does_not_pay"
    policy.observe_step("plain", 1, 1e-3)
    assert policy.costs.plain_s[1] == pytest.approx(5e-3)
    policy.observe_step("plain", 1, 1e-3)
    assert policy.costs.plain_s[1] == pytest.approx(1e-3)


def test_cost_is_the_lower_quartile_of_the_served_steps() -> None:
    """Timing noise only adds time: a stretch of slow steps (a third of the window) moves the
    cost nothing; once most of the window is slow, it does."""
    policy = SpecPolicy(K, COSTS)
    for _ in range(COST_WINDOW):
        policy.observe_step("spec", 1, 6e-3)
    for _ in range(COST_WINDOW // 3):
        policy.observe_step("spec", 1, 9e-3)
    assert policy.costs.spec_s[1] == pytest.approx(6e-3)
    for _ in range(COST_WINDOW * 3 // 4 - COST_WINDOW // 3 + 1):
        policy.observe_step("spec", 1, 9e-3)
    assert policy.costs.spec_s[1] == pytest.approx(9e-3)


def test_hysteresis_holds_speculation_through_a_few_doubts() -> None:
    """Speculating by cost, a step of the same size that no longer clears the margin holds
    ("hold") until OFF_AFTER decisions in a row say so; a paying one in between starts the
    count again. Another size or all-stale caches do not hold."""
    policy = SpecPolicy(K, COSTS)  # bs 1: break-even 1.2
    policy.observe([4] * 2000)
    assert policy.decide(1).reason == "pays"
    policy.observe([1] * 20 * HALF_LIFE)  # the estimate falls to ~1: does not pay
    assert [policy.decide(1).reason for _ in range(OFF_AFTER - 2)] == ["hold"] * (OFF_AFTER - 2)
    policy.observe([4] * 20 * HALF_LIFE)
    assert policy.decide(1).reason == "pays"  # the count starts again
    policy.observe([1] * 20 * HALF_LIFE)
    reasons = [policy.decide(1).reason for _ in range(OFF_AFTER + 1)]
    assert reasons == ["hold"] * (OFF_AFTER - 1) + ["does_not_pay"] * 2
    policy.observe([4] * 20 * HALF_LIFE)
    assert policy.decide(1).reason == "pays"
    policy.observe([1] * 20 * HALF_LIFE)
    assert policy.decide(4).reason == "does_not_pay"  # another captured size
    policy.observe([4] * 20 * HALF_LIFE)
    assert policy.decide(4).reason == "pays"
    policy.observe([1] * 20 * HALF_LIFE)
    assert policy.decide(4, num_stale=4).reason == "does_not_pay"  # nothing fresh to hold


def test_one_outlier_step_moves_no_cost() -> None:
    policy = SpecPolicy(K, COSTS)
    policy.observe_step("plain", 1, 10.0)  # e.g. a garbage-collection pause
    assert policy.costs.plain_s[1] == pytest.approx(5e-3)
    policy.observe_step("plain", 64, 10.0)  # past every captured size: ignored
    with pytest.raises(ValueError, match="kind"):
        policy.observe_step("verify", 1, 1e-3)
    unmeasured = SpecPolicy(K, None)
    unmeasured.observe_step("spec", 1, 1e-3)  # nothing to update
    assert unmeasured.costs is None


@pytest.mark.parametrize(("refresh_s", "refresh"), [(5.05e-3, True), (5.5e-3, False)])
def test_refresh_when_it_costs_little(refresh_s: float, refresh: bool) -> None:
    """Off by cost, the step keeps the draft caches fresh iff that costs <= 2% of a plain step
    (1% here: yes; 10%: no). Without a refresh measurement, never."""
    costs = StepCosts(plain_s={1: 5e-3}, spec_s={1: 50e-3}, refresh_s={1: refresh_s})
    assert costs.refresh_overhead(1) == pytest.approx(refresh_s / 5e-3 - 1)
    d = SpecPolicy(K, costs).decide(1)
    assert (d.speculate, d.reason, d.refresh) == (False, "does_not_pay", refresh)
    assert not SpecPolicy(K, COSTS).decide(16).refresh
    capped = SpecPolicy(K, costs, disable_batch_size=0).decide(1)
    assert (capped.reason, capped.refresh) == ("cap", refresh)
    all_stale = SpecPolicy(K, costs).decide(1, num_stale=1)  # nothing left to keep whole
    assert (all_stale.reason, all_stale.refresh) == ("does_not_pay", False)


def test_refresh_is_judged_by_the_startup_measurement() -> None:
    """Served plain steps that ran slow (another process, a long stretch of them) must not make
    a refresh look free: the refresh/plain ratio is the start-up one, measured side by side."""
    costs = StepCosts(plain_s={1: 5e-3}, spec_s={1: 50e-3}, refresh_s={1: 6e-3})
    policy = SpecPolicy(K, costs)
    for _ in range(COST_WINDOW):
        policy.observe_step("plain", 1, 8e-3)
    assert policy.costs.refresh_overhead(1) < 0  # live: refresh looks cheaper than plain
    assert not policy.decide(1).refresh


def test_speculation_needs_the_margin_over_the_break_even() -> None:
    """bs 1: break-even 1.2; an accept length 3% above it does not speculate, 8% does
    (SPEC_MARGIN 5%)."""
    assert SPEC_MARGIN == 0.05
    policy = SpecPolicy(K, COSTS)
    policy.observe([1.2 * 1.03] * 20 * HALF_LIFE)
    assert policy.decide(1).reason == "does_not_pay"
    policy.observe([1.2 * 1.08] * 20 * HALF_LIFE)
    assert policy.decide(1).reason == "pays"


def test_forced_decisions() -> None:
    policy = SpecPolicy(K, COSTS)
    policy.forced = FORCED_SPEC
    assert policy.decide(32) == FORCED_SPEC
    policy.forced = FORCED_PLAIN
    assert policy.decide(1) == FORCED_PLAIN
    policy.forced = FORCED_REFRESH
    assert policy.decide(1).refresh and not policy.decide(1).speculate


def test_cap_unmeasured_and_too_large() -> None:
    capped = SpecPolicy(K, COSTS, disable_batch_size=8)
    capped.observe([4] * 1000)
    assert capped.decide(8).speculate and not capped.decide(9).speculate
    assert capped.decide(9).reason == "cap"
    unmeasured = SpecPolicy(K, None, disable_batch_size=8)
    assert unmeasured.decide(8).reason == "unmeasured" and unmeasured.decide(8).speculate
    assert SpecPolicy(K, COSTS).decide(64).reason == "too_large"


def test_reset_observations_returns_to_the_prior() -> None:
    policy = SpecPolicy(K, COSTS)
    policy.observe([K + 1] * 500)  # e.g. the start-up measurement's synthetic prompts
    assert policy.accept_length_estimate > 3.5
    policy.reset_observations()
    assert policy.accept_length_estimate == pytest.approx(policy.prior)


def test_repeat_is_decide_for_an_all_stale_batch() -> None:
    """`repeat` stands for `decide(bs, bs)` again (an unchanged batch, every cache stale) while
    nothing the decision was made from changes: the same decision, counted alike, and the
    decisions off it counts lead to the next probe as decide's do. Two policies, one deciding
    every step and one repeating where it can, through served costs that move the break-even
    across 1 / (1 + margin) (speculative steps served cheaper than plain ones, then expired by
    plain ones), `forced`, a fresh batch."""
    costs = StepCosts(plain_s={4: 1.0}, spec_s={4: 2.0})
    twins = SpecPolicy(K, costs), SpecPolicy(K, costs)
    deciding, repeating = twins
    schedule = [("plain", 1.0)] * 40 + [("spec", 0.5)] * 60 + [("plain", 1.0)] * 140
    repeated, reasons = 0, set()
    for i, (kind, seconds) in enumerate(schedule):
        if i == 70:
            for p in twins:
                p.forced = FORCED_PLAIN
        if i == 80:
            for p in twins:
                p.forced = None
        expected = deciding.decide(4, num_stale=4)
        reasons.add(expected.reason)
        got = repeating.repeat()
        repeated += got is not None
        assert (got or repeating.decide(4, num_stale=4)) == expected, i
        for p in twins:
            p.observe_step(kind, 4, seconds)
    assert 100 < repeated < len(schedule)  # repeats where it can; decides where costs moved
    assert reasons == {"does_not_pay", "pays", "forced"}
    assert repeating.decisions == deciding.decisions
    # decisions off counted by repeat lead to the same probe for a batch with fresh caches
    for p in twins:  # break-even 1.3: a probe every PROBE_EVERY decisions off
        p.costs = StepCosts(plain_s={4: 1.0}, spec_s={4: 1.3})
        p.observe([1] * 2000)  # L_hat ~ 1: off by cost
    for _ in range(PROBE_EVERY * 2):
        deciding.decide(4, 4)
        assert repeating.repeat() is not None or repeating.decide(4, 4)
    fresh = [(p.decide(4, num_stale=0).reason, p.decide(4, num_stale=0).reason) for p in twins]
    assert fresh[0] == fresh[1] == ("probe", "probe")
    assert repeating.decisions == deciding.decisions


def test_repeat_only_after_a_plain_all_stale_decision() -> None:
    policy = SpecPolicy(K, COSTS)
    assert policy.repeat() is None  # nothing decided yet
    assert policy.decide(4, num_stale=0).speculate  # the prior pays at bs 4
    assert policy.repeat() is None
    policy.observe([1] * 2000)
    assert not policy.decide(16, num_stale=15).speculate  # one fresh cache: not repeatable
    assert policy.repeat() is None
    d = policy.decide(16, num_stale=16)
    assert policy.repeat() is d and policy.repeat() is d
    assert policy.decisions[(False, "does_not_pay")] == 4
    policy.costs = COSTS  # new costs: decide again
    assert policy.repeat() is None


def test_a_slow_startup_scales_the_unserved_kind_down() -> None:
    """The start-up rounds ran 1.67x slow (both kinds; the H200 case in the module doc): while
    only speculative steps are served, their cost falls to what serving shows and the plain
    figure falls with it, so the break-even stays the start-up ratio (2.23) instead of dropping
    to served spec / start-up plain (1.33), and an accept length of 1.6 does not pay. Scaling
    never goes up: slower served steps leave the other kind's figure alone."""
    slow = StepCosts(plain_s={1: 0.72e-3}, spec_s={1: 1.604e-3})
    policy = SpecPolicy(K, slow)
    for _ in range(COST_WINDOW):
        policy.observe_step("spec", 1, 0.96e-3)
    assert policy.costs.spec_s[1] == pytest.approx(0.96e-3)
    assert policy.costs.plain_s[1] == pytest.approx(0.72e-3 * 0.96 / 1.604)
    assert policy.costs.break_even(1) == pytest.approx(1.604 / 0.72)
    policy.observe([2] * 30 + [1] * 20)  # L_hat ~ 1.6
    assert policy.decide(1, num_stale=0).reason == "does_not_pay"
    for _ in range(COST_WINDOW):  # its own served steps outvote the scaled figure
        policy.observe_step("plain", 1, 0.38e-3)
    assert policy.costs.plain_s[1] == pytest.approx(0.38e-3)
    assert policy.costs.break_even(1) == pytest.approx(0.96 / 0.38)
    dearer = SpecPolicy(K, slow)
    for _ in range(COST_WINDOW):
        dearer.observe_step("spec", 1, 3e-3)
    assert dearer.costs.plain_s[1] == pytest.approx(0.72e-3)


def test_a_slow_stretch_of_plain_steps_scales_the_speculative_figure_up() -> None:
    """As in the H100 case of the module doc (default model, bs 16): served plain steps run
    1.3x their start-up figure (the host runs slower) while no speculative step is served: the
    speculative figure scales up alike and the break-even stays the start-up ratio (2.0), so an
    accept length of ~1.8 still does not pay (scaled down only, the break-even fell to 1.54 and
    speculation turned on). Speculative steps served dearer than their start-up figure do not
    scale the plain one up: that is what turns speculation off."""
    costs = StepCosts(plain_s={16: 0.26e-3}, spec_s={16: 0.52e-3})
    policy = SpecPolicy(2, costs)
    policy.observe([2] * 40 + [1] * 10)  # L_hat ~ 1.8
    assert policy.decide(16, num_stale=0).reason == "does_not_pay"
    policy.observe_steps("plain", 16, [0.338e-3] * COST_WINDOW)
    assert policy.costs.plain_s[16] == pytest.approx(0.338e-3)
    assert policy.costs.spec_s[16] == pytest.approx(0.52e-3 * 1.3)
    assert policy.costs.break_even(16) == pytest.approx(2.0)
    assert policy.decide(16, num_stale=0).reason == "does_not_pay"
    dearer = SpecPolicy(2, costs)
    dearer.observe_steps("spec", 16, [1.04e-3] * COST_WINDOW)
    assert dearer.costs.plain_s[16] == pytest.approx(0.26e-3)
    assert dearer.costs.break_even(16) == pytest.approx(4.0)


def test_an_unobserved_kinds_slow_stretch_expires() -> None:
    """The H100 case in the module doc (default model, k = 2, bs 1): a stretch of 32 plain steps
    at 7x their cost, after speculative steps were served at their start-up cost,
    makes speculation look paying (the served speculative steps, not the scaled start-up
    figure, are its cost's lower quartile); the policy then serves only speculative steps, and
    after EXPIRE_AFTER of them the plain steps it no longer sees expire, its plain cost is the
    start-up figure again and it turns back to plain (after the hysteresis)."""
    policy = SpecPolicy(2, StepCosts(plain_s={1: 0.26e-3}, spec_s={1: 0.84e-3}))
    policy.observe([2] * 30 + [1] * 30)  # L_hat ~ 1.6 against a break-even of 3.2
    assert policy.decide(1).reason == "does_not_pay"
    policy.observe_steps("spec", 1, [0.84e-3] * 8)
    policy.observe_steps("plain", 1, [1.9e-3] * COST_WINDOW)
    assert policy.costs.plain_s[1] == pytest.approx(1.9e-3)
    assert policy.decide(1).reason == "pays"
    for _ in range(EXPIRE_AFTER - 1):
        policy.observe_step("spec", 1, 0.84e-3)
    assert policy.costs.plain_s[1] == pytest.approx(1.9e-3)
    assert policy.repeat() is None  # (a speculating decision is never repeated)
    assert policy.decide(1).reason == "pays"
    policy.observe_step("spec", 1, 0.84e-3)
    assert policy.costs.plain_s[1] == pytest.approx(0.26e-3)
    reasons = [policy.decide(1).reason for _ in range(OFF_AFTER)]
    assert reasons == ["hold"] * (OFF_AFTER - 1) + ["does_not_pay"]
    # plain steps observed again reset the count: spec steps expire nothing before EXPIRE_AFTER
    policy.observe_steps("plain", 1, [0.26e-3] * 8)
    for _ in range(EXPIRE_AFTER - 1):
        policy.observe_step("spec", 1, 0.84e-3)
    assert policy.served_steps("plain", 1) == [0.26e-3] * 8
