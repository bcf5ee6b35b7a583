"""bench/soak.py: its seeded mix (fast), and short soaks of the CPU default model (slow), with
and without speculation, plus issue 40's crash recipe scaled down; each run's JSON line must
report every check passed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import KINDS, Limits, Outcome, Planned, compare, near_tie, plan_list

REPO_ROOT = Path(__file__).resolve().parents[2]
# The CPU soaks: a 256-token context over a 12-page pool of 16 (176 tokens for one request, so
# some requests are refused for the pool and long ones preempt each other), bursts of 6-16.
SMALL = [
    "--max-tokens", "24", "--concurrency", "16", "--burst-min", "6", "--burst-max", "16",
    "--steady-min", "4", "--steady-max", "12", "--gap-s", "0.3", "--max-reruns", "30",
    "--request-timeout-s", "180", "--drain-timeout-s", "180", "--startup-timeout-s", "180",
    "--max-model-len", "256", "--page-size", "16", "--num-pages", "12",
]  # fmt: skip
LIMITS = Limits(max_model_len=256, vocab_size=4096, max_tokens=24, pool_tokens=176)


def _prompt_bound(item: Planned) -> int:
    """Most tokens the prompt may take (byte-level BPE: a token a byte, plus BOS; chat: plus
    the template's)."""
    if item.endpoint == "chat":
        return sum(len(m["content"].encode()) for m in item.body["messages"]) + 64
    prompt = item.body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.encode()) + 1


def test_same_seed_same_requests():
    first = plan_list(7, LIMITS, 300)
    assert first == plan_list(7, LIMITS, 300)
    assert first != plan_list(8, LIMITS, 300)


def test_mix_holds_every_kind_within_limits():
    items = plan_list(1, LIMITS, 1000)
    kinds = {k for item in items for k in item.kinds}
    assert kinds == set(KINDS) - {"spec_refused"}
    for item in items:
        total = _prompt_bound(item) + item.body["max_tokens"]
        if "over_pool" in item.kinds:
            assert item.expect_400 and LIMITS.fit < total <= LIMITS.max_model_len
        else:
            assert item.expect_400 is None and total <= LIMITS.fit, item
    at_limit = [i for i in items if {"at_limit", "at_limit_minus_1"} & set(i.kinds)]
    assert all(len(i.body["prompt"]) + i.body["max_tokens"] == LIMITS.fit for i in at_limit)
    assert any(i.body["max_tokens"] == 1 and len(i.body["prompt"]) == 175 for i in at_limit)


def test_speculation_expects_its_refusals():
    items = plan_list(1, Limits(256, 4096, 24, 176 - 4, spec=True), 1000)
    refused = [i for i in items if "spec_refused" in i.kinds]
    assert refused and all(i.expect_400 == "speculative" for i in refused)
    assert all(
        "spec_refused" in i.kinds for i in items if {"prompt_logprobs", "structured"} & set(i.kinds)
    )


def _outcome(text: str, tokens: list[str] | None, tops: list[list[float]] | None = None):
    item = Planned(3, "completions", {"prompt": [5], "max_tokens": 4, "temperature": 0}, ())
    o = Outcome(item, status=200, complete=True, completion_tokens=len(text))
    o.texts[0], o.finish[0] = text, "length"
    if tokens is not None:
        o.tokens[0] = tokens
    if tops is not None:
        o.tops[0] = tops
    return o


def test_server_env_takes_name_value_pairs():
    from bench.soak import server_env

    assert server_env(["MLASERVE_STEP_RING=0", "X=a=b"]) == {"MLASERVE_STEP_RING": "0", "X": "a=b"}
    with pytest.raises(SystemExit, match="expected NAME=VALUE"):
        server_env(["MLASERVE_STEP_RING"])


def test_compare_finds_the_divergent_token_and_its_gap():
    tops = [[-0.1, -3.0], [-0.5, -0.6], [-0.2, -2.2], [-0.3, -1.0]]
    alone = _outcome("abcd", list("abcd"), tops)
    assert compare(_outcome("abcd", list("abcd")), alone) is None
    by_tokens = compare(_outcome("abxd", list("abxd")), alone)
    assert (by_tokens["position"], by_tokens["logit_gap"], by_tokens["compared_by"]) == (
        2, 2.0, "tokens",
    )  # fmt: skip
    by_text = compare(_outcome("axcd", None), alone)
    assert (by_text["position"], by_text["logit_gap"], by_text["compared_by"]) == (1, 0.1, "text")
    # a near tie agrees, a margin or an unknown gap (the alone run ended first) does not
    assert near_tie(by_text, 0.1) and not near_tie(by_text, 0.05)
    assert not near_tie(by_tokens, 0.1)
    past_end = compare(_outcome("abcdz", list("abcdz")), alone)
    assert past_end["logit_gap"] is None and not near_tie(past_end, 10.0)


def _run(script: str, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / script), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.strip(), tail
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == (0 if report["ok"] else 1), tail
    return report | {"_tail": tail}


def _assert_soak_passed(report: dict) -> None:
    tail = report["_tail"]
    assert report["ok"], tail
    assert report["outcomes"].get("5xx", 0) == 0, tail
    assert report["health"] == 200 and report["exit_code"] == 0, tail
    idle = report["idle"]
    assert (idle["running"], idle["waiting"], idle["kv_usage"]) == (0, 0, 0), tail
    assert report["greedy"]["compared"] > 0 and report["greedy"]["fraction"] >= 0.99, tail
    assert report["kinds"].get("over_pool", 0) + report["kinds"].get("at_limit", 0) > 0, tail


@pytest.mark.slow
def test_soak_cpu_overlap_schedule():
    """Without speculation, with the overlap schedule the GPU uses by default (issue 40's race
    was in it)."""
    _assert_soak_passed(
        _run("soak.py", "--seed", "11", "--duration-s", "20", *SMALL, "--overlap-schedule")
    )


@pytest.mark.slow
def test_soak_cpu_speculation():
    """The default model has an MTP layer (num_nextn_predict_layers 1): speculation on, where
    prompt_logprobs and structured output must be refused with 400 and nothing else changes."""
    report = _run("soak.py", "--seed", "12", "--duration-s", "20", *SMALL,
                  "--num-speculative-tokens", "2")  # fmt: skip
    _assert_soak_passed(report)
    assert report["limits"]["spec"] and report["outcomes"].get("expected_400", 0) > 0


@pytest.mark.slow
def test_crash_recipe_scaled_down():
    report = _run(
        "crash_recipe.py", "--requests", "12", "--prompt-min", "16", "--prompt-max", "128",
        "--output-tokens", "12", "--concurrency", "6", "--late-streams", "4",
        "--late-prompt", "32", "--max-model-len", "256",
    )  # fmt: skip
    assert report["ok"], report["_tail"]
    assert [p["ok"] for p in report["phases"]] == [12, 5], report["_tail"]
    # the serving figures: 12 x 12 tokens in phase 1, TPOT from every stream
    assert report["phases"][0]["output_tokens"] == 144
    assert all(p["output_tok_s"] > 0 and p["tpot_p90_ms"] >= p["tpot_p50_ms"] > 0
               for p in report["phases"]), report["phases"]  # fmt: skip
