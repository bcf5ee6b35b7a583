from __future__ import annotations

import pytest

from mlaserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, "n: must be >= 1, got 0"),
        ("n", 1.5, "n: must be an integer"),
        ("max_tokens", 0, "max_tokens: must be >= 1, got 0"),
        ("temperature", -0.1, "temperature: must be >= 0.0"),
        ("temperature", float("nan"), "temperature: must be finite"),
        ("temperature", True, "temperature: must be a number"),
        ("top_p", 0.0, "top_p: must be > 0.0"),
        ("top_p", 1.01, "top_p: must be <= 1.0"),
        ("top_k", -2, "top_k: must be >= -1"),
        ("min_p", 1.5, "min_p: must be <= 1.0"),
        ("seed", "7", "seed: must be an integer"),
        ("stop", [""], "stop: stop strings must be non-empty"),
        ("stop", [1], "stop: must be a string or a list of strings"),
        ("stop_token_ids", [-1], "stop_token_ids: ids must be >= 0"),
        ("stop_token_ids", "2", "stop_token_ids: must be a list of integers"),
        ("logprobs", -1, "logprobs: must be >= 0"),
        ("logprobs", MAX_LOGPROBS + 1, f"logprobs: must be <= {MAX_LOGPROBS}"),
        ("repetition_penalty", 0.0, "repetition_penalty: must be > 0.0"),
        ("frequency_penalty", 2.5, "frequency_penalty: must be <= 2.0"),
        ("presence_penalty", -2.5, "presence_penalty: must be >= -2.0"),
        ("min_tokens", -1, "min_tokens: must be >= 0"),
        ("ignore_eos", 1, "ignore_eos: must be a boolean"),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(SamplingParamsError, match="^" + message.replace("(", r"\(")) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)


def test_min_tokens_cannot_exceed_max_tokens() -> None:
    with pytest.raises(SamplingParamsError, match="min_tokens: must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=5)


def test_normalisation() -> None:
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.stop_strings == ["###"]
    assert p.stop_token_ids == [] and p.top_k == 0
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


def test_replace_validates_and_copies_lists() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[3])
    q = p.replace(temperature=0.5)
    assert q.temperature == 0.5 and q.stop == ["x"]
    assert q.stop is not p.stop and q.stop_token_ids is not p.stop_token_ids
    with pytest.raises(SamplingParamsError, match=r"^top_p"):
        p.replace(top_p=2.0)
    assert p.clone() == p


def test_for_sample_fans_out_seeds() -> None:
    p = SamplingParams(n=3, seed=10)
    assert [p.for_sample(i).seed for i in range(3)] == [10, 11, 12]
    assert all(p.for_sample(i).n == 1 for i in range(3))
    assert SamplingParams(n=2).for_sample(1).seed is None
    with pytest.raises(ValueError):
        p.for_sample(3)


def test_check_vocab() -> None:
    SamplingParams(stop_token_ids=[9]).check_vocab(10)
    with pytest.raises(SamplingParamsError, match=r"^stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).check_vocab(10)
