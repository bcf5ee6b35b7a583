"""The speculation policy's decisions from measured step costs (given here as data: seconds per
step per batch size, shaped like an H100 measurement) and observed accept lengths."""

from __future__ import annotations

import pytest

from mlaserve.spec.spec_policy import (
    HALF_LIFE,
    PROBE_EVERY,
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


def test_prior_decides_before_any_observation() -> None:
    policy = SpecPolicy(K, COSTS)  # prior 2.18: pays below break-even 2.18
    assert [policy.decide(bs).speculate for bs in (1, 4, 16, 32)] == [True, True, False, False]
    assert policy.decisions[(True, "pays")] == 2
    assert policy.decisions[(False, "does_not_pay")] == 2


def test_observed_accept_lengths_move_the_decision() -> None:
    policy = SpecPolicy(K, COSTS)
    policy.observe([4] * 200)  # every draft accepted
    assert policy.accept_length_estimate > 3.8
    assert all(policy.decide(bs).speculate for bs in (1, 4, 16, 32))
    policy.observe([1] * 20 * HALF_LIFE)  # nothing accepted any more: the past fades
    assert policy.accept_length_estimate < 1.1
    assert [policy.decide(bs).reason for bs in (1, 32)] == ["does_not_pay"] * 2


def test_probe_while_off() -> None:
    policy = SpecPolicy(K, COSTS)
    policy.observe([1] * 1000)
    reasons = [policy.decide(16).reason for _ in range(2 * PROBE_EVERY)]
    assert reasons.count("probe") == 2
    assert reasons[PROBE_EVERY - 1] == reasons[2 * PROBE_EVERY - 1] == "probe"


def test_cap_unmeasured_and_too_large() -> None:
    capped = SpecPolicy(K, COSTS, disable_batch_size=8)
    capped.observe([4] * 1000)
    assert capped.decide(8).speculate and not capped.decide(9).speculate
    assert capped.decide(9).reason == "cap"
    unmeasured = SpecPolicy(K, None, disable_batch_size=8)
    assert unmeasured.decide(8).reason == "unmeasured" and unmeasured.decide(8).speculate
    assert SpecPolicy(K, COSTS).decide(64).reason == "too_large"
