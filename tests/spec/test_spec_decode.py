"""Speculative decoding on CPU (reference backend, eager): lossless against speculation off,
full acceptance with a draft that is the target itself, stop conditions inside an accepted
window, pages all free at the end."""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams, llm_engine
from mlaserve.spec import StepCosts
from mlaserve.spec.spec_decoder import OBSERVE_EVERY
from mlaserve.spec.spec_policy import FORCED_PLAIN, FORCED_REFRESH, FORCED_SPEC
from tests.spec.oracle_drafter import OracleDrafter
from tests.spec.spec_prompts import prompts_for, token_ids

K = 3
NEW_TOKENS = 16
CPU = {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "auto", "page_size": 4}


def assert_pages_free(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages
    assert stats.num_running == stats.num_waiting == 0


@pytest.fixture(scope="module")
def mtp_path(checkpoint):
    return str(checkpoint("v3_mtp"))


@pytest.fixture(scope="module")
def reference(mtp_path):
    """Speculation off: greedy continuations (long enough for the oracle's look-ahead)."""
    prompts = prompts_for(512)
    greedy = SamplingParams(max_tokens=NEW_TOKENS + 2 * K, temperature=0.0, ignore_eos=True)
    llm = LLM(mtp_path, **CPU)
    return llm, prompts, token_ids(llm.generate(prompts, greedy))


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_greedy_lossless_mtp_draft(mtp_path, reference, max_num_seqs: int) -> None:
    _, prompts, expected = reference
    llm = LLM(mtp_path, num_speculative_tokens=K, max_num_seqs=max_num_seqs, **CPU)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = token_ids(llm.generate(prompts, params))
    assert got == [e[:NEW_TOKENS] for e in expected]
    stats = llm.engine.get_stats()
    # Every request decodes NEW_TOKENS - 1 tokens after its first through verify steps.
    assert stats.spec_num_drafts >= (NEW_TOKENS - 1) * len(prompts) // (K + 1)
    assert stats.spec_num_draft_tokens == K * stats.spec_num_drafts
    assert sum(stats.spec_accept_lengths.values()) == stats.spec_num_drafts
    assert_pages_free(llm)


def oracle_llm(mtp_path: str, reference, **kw) -> LLM:
    _, prompts, expected = reference
    llm = LLM(mtp_path, num_speculative_tokens=K, **CPU, **kw)
    futures = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    llm.engine.spec_decoder.drafter = OracleDrafter(K, futures)
    return llm


def test_self_speculation_accepts_every_token(mtp_path, reference) -> None:
    _, prompts, expected = reference
    llm = oracle_llm(mtp_path, reference)
    n = 1 + 4 * (K + 1)  # the prefill's token, then four full windows
    results = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    assert token_ids(results) == [e[:n] for e in expected]
    stats = llm.engine.get_stats()
    assert stats.spec_accept_lengths == {K + 1: 4 * len(prompts)}
    assert stats.spec_accepted_per_pos == [4 * len(prompts)] * K
    assert all(r.outputs[0].finish_reason == "length" for r in results)
    assert all(r.metrics.num_draft_tokens == 4 * K for r in results)
    assert all(r.metrics.num_accepted_tokens == 4 * K for r in results)
    assert_pages_free(llm)


def test_seeded_sampling_is_reproducible(mtp_path, reference) -> None:
    """Sampled requests go through `sampling/rejection.accept_draft` (lossless in distribution,
    its chi-square tests are in tests/sampling): not token-identical to speculation off, but
    keyed by (seed, output index), so a seeded request emits the same tokens on every run and
    its first token (sampled after the prefill, before any verify) is speculation-off's."""
    base, prompts, _ = reference
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=t, top_p=0.9, seed=i, ignore_eos=True)
        for i, t in enumerate([0.7, 1.0, 1.3, 0.5, 1.0, 0.8, 1.1, 0.9])
    ]
    expected = token_ids(base.generate(prompts, params))
    llm = LLM(mtp_path, num_speculative_tokens=K, **CPU)
    first, second = (
        token_ids(llm.generate(prompts, params)),
        token_ids(llm.generate(prompts, params)),
    )
    assert first == second
    assert [t[0] for t in first] == [t[0] for t in expected]
    assert all(len(t) == NEW_TOKENS for t in first)
    assert llm.engine.get_stats().spec_num_drafts > 0
    assert_pages_free(llm)


def _stop_cases(expected: list[list[int]], tokenizer) -> list[SamplingParams]:
    """Stops that fire inside a verify window (output index 6: window [5, 9) with K = 3)."""
    e = expected[2]
    text = tokenizer.decode(e[:7])
    return [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # max_tokens mid-window
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=[e[6]]),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[text[-2:]]),
        SamplingParams(
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            stop=[text[-2:]],
            include_stop_str_in_output=True,
        ),
    ]


def test_stops_inside_an_accepted_window(mtp_path, reference) -> None:
    base, prompts, expected = reference
    llm = oracle_llm(mtp_path, reference)
    for params in _stop_cases(expected, base.tokenizer):
        want = base.generate(prompts, params)
        got = llm.generate(prompts, params)
        for w, g in zip(want, got, strict=True):
            w, g = w.outputs[0], g.outputs[0]
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
                w.token_ids,
                w.text,
                w.finish_reason,
                w.stop_reason,
            ), params
        assert want[2].outputs[0].finish_reason in ("stop", "length")
        assert len(want[2].outputs[0].token_ids) <= 7
    assert_pages_free(llm)


def test_eos_inside_an_accepted_window(mtp_path, reference) -> None:
    """An EOS id the target emits mid-window ends the request there, as without speculation
    (the model's EOS is made the token at output index 6 of one prompt)."""
    base, prompts, expected = reference
    eos = expected[2][6]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    llm = oracle_llm(mtp_path, reference)
    saved = base.engine.eos_token_ids
    for engine in (base.engine, llm.engine):
        engine.eos_token_ids = [eos]
    try:
        want, got = base.generate(prompts, params), llm.generate(prompts, params)
    finally:
        base.engine.eos_token_ids = saved
    assert token_ids(got) == token_ids(want)
    assert [g.outputs[0].finish_reason for g in got] == [w.outputs[0].finish_reason for w in want]
    assert got[2].outputs[0].token_ids[-1] == eos and len(got[2].outputs[0].token_ids) <= 7
    assert_pages_free(llm)


def test_context_end_inside_a_window(mtp_path, reference) -> None:
    """Requests that run into max_model_len mid-window stop where speculation-off stops (the
    verify and draft forwards may write past it: the lookahead pages exist)."""
    _, prompts, _ = reference
    llm = oracle_llm(mtp_path, reference, max_model_len=50)
    base = LLM(mtp_path, max_model_len=50, **CPU)
    long = [p for p in prompts if len(p) >= 20]  # 33 and 48 tokens: 17 and 2 left
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    want, got = base.generate(long, params), llm.generate(long, params)
    assert token_ids(got) == token_ids(want)
    assert [len(p) + len(g.outputs[0].token_ids) for p, g in zip(long, got)] == [50] * len(long)
    assert_pages_free(llm)


def test_logprobs_of_every_emitted_token(mtp_path, reference) -> None:
    base, prompts, _ = reference
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2)
    want = base.generate(prompts[:3], params)
    got = oracle_llm(mtp_path, reference).generate(prompts[:3], params)
    for w, g in zip(want, got, strict=True):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 9
        for wl, gl in zip(w.logprobs, g.logprobs, strict=True):
            assert wl.keys() == gl.keys()
            for t in wl:
                assert gl[t].rank == wl[t].rank
                assert gl[t].logprob == pytest.approx(wl[t].logprob, abs=1e-4)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("refresh_cost", [1.01, 1.5])
def test_policy_switches_between_plain_and_speculative_steps(
    mtp_path, reference, refresh_cost: float, overlap: bool
) -> None:
    """Step costs under which speculation pays only at batch size <= 2 (data, as a GPU start-up
    would measure them; the served steps' CPU wall times are not followed): two long requests
    speculate; six short ones arrive and the batch of eight runs plain steps. When a draft-cache
    refresh costs 1% of a plain step, those steps refresh, and once the six are done the two
    speculate again; at 50% they skip it, the two's caches go stale, and they stay plain (a
    stale cache counts as accept length 1). Outputs stay speculation-off's, also with overlap
    scheduling (plain steps then overlap, as on CUDA)."""
    _, prompts, expected = reference
    llm = LLM(mtp_path, num_speculative_tokens=K, max_num_seqs=8, overlap_schedule=overlap, **CPU)
    engine = llm.engine
    policy = engine.spec_decoder.policy
    policy.follow_served_steps = False
    policy.costs = StepCosts(
        plain_s={2: 1.0, 4: 1.0, 8: 1.0},
        spec_s={2: 1.1, 4: 5.0, 8: 5.0},
        refresh_s={2: refresh_cost, 4: refresh_cost, 8: refresh_cost},
    )
    long = SamplingParams(max_tokens=len(expected[0]), temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out: dict[int, list[int]] = {}

    def step() -> None:
        for o in engine.step():
            out[int(o.request_id)] = list(o.outputs[0].token_ids)

    for i in (0, 1):
        engine.add_request(str(i), prompts[i], long)
    for _ in range(3):
        step()
    assert engine.get_stats().spec_num_drafts > 0
    for i in range(2, 8):
        engine.add_request(str(i), prompts[i], short)
    while any(str(i) in engine.requests for i in range(2, 8)):
        step()
    assert engine.get_stats().spec_decisions.get("off:does_not_pay", 0) > 0
    fresh = [engine.requests[str(i)].draft_cache_valid for i in (0, 1)]
    drafts_after_crowd = engine.get_stats().spec_num_drafts
    while engine.has_unfinished_requests():
        step()
    resumed = engine.get_stats().spec_num_drafts > drafts_after_crowd
    assert fresh == [refresh_cost < 1.02] * 2
    assert resumed == (refresh_cost < 1.02)
    assert [out[i] for i in range(8)] == [e if i < 2 else e[:6] for i, e in enumerate(expected)]
    assert_pages_free(llm)


def test_plain_steps_overlap_like_an_engine_without_speculation(mtp_path, reference) -> None:
    """With overlap scheduling, a step the policy keeps plain is launched before the previous
    step's tokens are read back (one host wait per step: the previous step's), as in an engine
    without speculation; a speculative step first resolves the step in flight. Switching back
    and forth leaves the outputs speculation-off's and no page held."""
    _, prompts, expected = reference
    llm = LLM(mtp_path, num_speculative_tokens=K, max_num_seqs=4, overlap_schedule=True, **CPU)
    engine, runner = llm.engine, llm.engine.runner
    policy = engine.spec_decoder.policy
    params = SamplingParams(max_tokens=len(expected[0]), temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), prompts[i], params)
    out: dict[int, list[int]] = {}

    def step() -> None:
        for o in engine.step():
            out[int(o.request_id)] = list(o.outputs[0].token_ids)

    policy.forced = FORCED_PLAIN
    for _ in range(4):  # the prefill, then plain steps
        step()
    for _ in range(3):
        waits = runner.num_host_waits
        step()
        assert engine._inflight is not None and runner.num_host_waits == waits + 1
    assert engine.get_stats().spec_num_drafts == 0
    policy.forced = FORCED_SPEC
    for _ in range(3):  # drafts (from stale caches), then verify steps
        step()
        assert engine._inflight is None
    assert engine.get_stats().spec_num_drafts > 0
    policy.forced = FORCED_PLAIN
    for _ in range(3):
        step()
    assert engine._inflight is not None
    policy.forced = FORCED_SPEC
    while engine.has_unfinished_requests():
        step()
    assert [out[i] for i in range(3)] == expected[:3]
    assert_pages_free(llm)


def test_a_prefill_the_policy_keeps_plain_runs_no_draft_pass(
    mtp_path, reference, monkeypatch
) -> None:
    """With overlap scheduling, step costs under which speculation never pays and a refresh
    costs half a step (data, as a GPU start-up would measure them), every step runs as a plain
    engine's, the prefill included: the draft never runs, not even over the prompts, and the
    caches are stale from the first step. Outputs are speculation-off's, no page stays held.
    Once the batch is steady, its plain steps do no per-request work in the decoder and the
    policy repeats its decision (`SpecPolicy.repeat`), each still counted. Prefix caching off:
    with it on the prompt's draft pass always runs (tests/engine/test_prefix_cache_engine.py)."""
    _, prompts, expected = reference
    llm = LLM(mtp_path, num_speculative_tokens=K, max_num_seqs=4, overlap_schedule=True,
              enable_prefix_caching=False, **CPU)  # fmt: skip
    engine = llm.engine
    policy = engine.spec_decoder.policy
    policy.follow_served_steps = False
    policy.costs = StepCosts(plain_s={4: 1.0}, spec_s={4: 9.0}, refresh_s={4: 1.5})
    drafter = engine.spec_decoder.drafter
    passes = []
    full = []  # the decoder's per-request decisions
    real_decide = engine.spec_decoder._decide
    monkeypatch.setattr(
        engine.spec_decoder, "_decide", lambda *a: full.append(1) or real_decide(*a)
    )
    for name in ("after_extend", "after_decode"):
        real = getattr(drafter, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            passes.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(drafter, name, counted)
    params = SamplingParams(max_tokens=len(expected[0]), temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), prompts[i], params)
    out: dict[int, list[int]] = {}
    engine.step()  # the prefill
    assert engine._inflight is not None, "the prefill was not launched as a plain step"
    assert not any(r.draft_cache_valid for r in engine.requests.values())
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[int(o.request_id)] = list(o.outputs[0].token_ids)
    for o in engine.drain():
        out[int(o.request_id)] = list(o.outputs[0].token_ids)
    assert passes == []
    assert engine.get_stats().spec_num_drafts == 0
    assert [out[i] for i in range(3)] == expected[:3]
    assert_pages_free(llm)
    # the prefill and the first decode step decide per request; the rest repeat
    steps = len(expected[0])
    assert len(full) == 2 and steps > 8
    assert engine.get_stats().spec_decisions == {"off:does_not_pay": steps}


def test_stops_in_an_overlapped_plain_step(mtp_path, reference, monkeypatch) -> None:
    """A request whose stop token comes in an overlapped plain step is already scheduled for the
    next step when that token is read back. When the next step speculates (it resolves the
    plain step first), the request has ended and released its pages: the step goes on without
    it. Decisions alternate between plain and speculative steps; outputs equal speculation
    off's with the same stop ids, and no page stays held."""
    _, prompts, expected = reference
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=[e[2 + i % 9]])
        for i, e in enumerate(expected)
    ]
    want = token_ids(LLM(mtp_path, **CPU).generate(prompts, params))
    llm = LLM(mtp_path, num_speculative_tokens=K, max_num_seqs=8, overlap_schedule=True, **CPU)
    engine = llm.engine
    policy = engine.spec_decoder.policy
    dropped = []  # requests that ended in the read-back before a speculative step

    def without_finished(scheduled):
        kept = real(scheduled)
        dropped.append(len(scheduled.scheduled) - len(kept.scheduled))
        return kept

    real = llm_engine._without_finished
    monkeypatch.setattr(llm_engine, "_without_finished", without_finished)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    out: dict[int, list[int]] = {}
    pattern = [FORCED_PLAIN, FORCED_PLAIN, FORCED_SPEC]
    step = 0
    while engine.has_unfinished_requests():
        policy.forced = pattern[step % len(pattern)]
        for o in engine.step():
            out[int(o.request_id)] = list(o.outputs[0].token_ids)
        step += 1
    policy.forced = None
    assert sum(dropped) > 0, "no stop fell in a plain step before a speculative one"
    assert [out[i] for i in range(len(prompts))] == want
    assert_pages_free(llm)


def _mtp_cache_after(llm: LLM, prompt: list[int], decisions: list) -> tuple:
    """Run one greedy request with the policy forced to `decisions[i]` at step i (the last one
    for the rest) until it holds 28 tokens past its prompt; -> (its tokens, the MTP layer's
    fp32 KV at positions 0..num_tokens-2: the ones whose next token is known), then abort it."""
    engine = llm.engine
    policy = engine.spec_decoder.policy
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine.add_request("r", prompt, params)
    step = 0
    while engine.requests["r"].num_tokens < len(prompt) + 28:
        policy.forced = decisions[min(step, len(decisions) - 1)]
        engine.step()
        step += 1
    policy.forced = None
    request = engine.requests["r"]
    mtp_layer = engine.model_config.num_hidden_layers
    pool = engine.runner.kv_pool
    kv = pool.gather(mtp_layer, torch.tensor([request.pages]))[0, : request.num_tokens - 1]
    tokens, valid = request.tokens(0, request.num_tokens), request.draft_cache_valid
    engine.abort_request("r")
    assert_pages_free(llm)
    return tokens, kv, valid


def test_refresh_keeps_the_draft_cache_whole(mtp_path, reference) -> None:
    """Speculating, then 8 plain steps that refresh the draft's cache, then speculating again
    leaves the MTP layer's KV what always speculating leaves (fp32 reference backend: equal to
    1e-4); 8 plain steps without the refresh leave holes (and mark the cache stale)."""
    _, prompts, _ = reference
    llm = LLM(mtp_path, num_speculative_tokens=K, max_num_seqs=1, **CPU)
    on, refresh, plain = FORCED_SPEC, FORCED_REFRESH, FORCED_PLAIN
    tokens_a, kv_a, valid_a = _mtp_cache_after(llm, prompts[5], [on])
    tokens_b, kv_b, valid_b = _mtp_cache_after(llm, prompts[5], [on] * 3 + [refresh] * 8 + [on])
    tokens_c, kv_c, valid_c = _mtp_cache_after(llm, prompts[5], [on] * 3 + [plain] * 8 + [on])
    n = min(len(kv_a), len(kv_b), len(kv_c))
    assert tokens_a[: n + 1] == tokens_b[: n + 1] == tokens_c[: n + 1]  # lossless all three
    assert valid_a and valid_b and not valid_c
    torch.testing.assert_close(kv_b[:n], kv_a[:n], atol=1e-4, rtol=1e-4)
    holes = (kv_c[:n] - kv_a[:n]).abs().amax(dim=1) > 1e-3
    assert 8 <= int(holes.sum()) <= 8 + 2 * (K + 1), holes.nonzero().flatten().tolist()


def test_served_steps_update_the_costs(mtp_path, reference) -> None:
    """Each steady-state decode step's wall time reaches the policy: start-up costs of 1000 s
    (absurd on purpose) move toward what the steps really took, per kind; prefill steps and the
    steps that switch between kinds are not counted. (A kind not served yet follows the other
    down: the start-up ran slow by their ratio, `spec_policy`'s module doc.)"""
    _, prompts, _ = reference
    llm = LLM(mtp_path, num_speculative_tokens=K, max_num_seqs=2, **CPU)
    policy = llm.engine.spec_decoder.policy
    policy.costs = StepCosts(plain_s={2: 1000.0}, spec_s={2: 1000.0})
    policy.forced = FORCED_SPEC
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params)
    spec_after = policy.costs.spec_s[2]
    spec_served = policy.served_steps("spec", 2)
    # the cost now comes from the served steps, whatever they took (no wall-time bound)
    assert spec_served and spec_after <= max(spec_served)
    assert policy.served_steps("plain", 2) == []  # no steady plain step ran
    assert policy.costs.plain_s[2] == pytest.approx(spec_after)  # scaled alike (ratio 1)
    assert policy.startup_costs.spec_s[2] == policy.startup_costs.plain_s[2] == 1000.0
    policy.forced = FORCED_PLAIN
    llm.generate(prompts[:2], params)
    plain_served = policy.served_steps("plain", 2)
    assert plain_served and policy.costs.plain_s[2] <= max(plain_served)
    assert policy.served_steps("spec", 2) == spec_served


def test_only_settled_batches_feed_the_costs(mtp_path, reference) -> None:
    """A decode step's wall time reaches the policy only when the step before was of the same
    kind over the same requests: the first steps after a prefill or an arrival are slower than
    settled ones and would make speculation look dearer than it is. Speculative steps report
    each step, plain ones in groups of OBSERVE_EVERY."""
    _, prompts, _ = reference
    llm = LLM(mtp_path, num_speculative_tokens=K, max_num_seqs=2, **CPU)
    engine = llm.engine
    policy = engine.spec_decoder.policy
    policy.costs = StepCosts(plain_s={2: 1.0}, spec_s={2: 1.0})
    policy.forced = FORCED_SPEC
    seen: list[tuple[str, int]] = []
    policy.observe_steps = lambda kind, bs, seconds: seen.extend((kind, bs) for _ in seconds)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompts[2], params)
    engine.step()  # a's prefill
    engine.step()  # a's first verify: the batch changed (was a prefill)
    assert seen == []
    engine.step()
    engine.step()
    assert seen == [("spec", 1)] * 2
    engine.add_request("b", prompts[3], params)
    engine.step()  # b's prefill (with a's decode): not a decode step
    engine.step()  # the first verify of {a, b}
    assert seen == [("spec", 1)] * 2
    engine.step()
    assert seen == [("spec", 1)] * 2 + [("spec", 2)]
    policy.forced = FORCED_PLAIN
    engine.step()  # verifies the drafts both hold, drafts none: a switch, not counted
    engine.step()  # the first plain step
    engine.step()
    assert seen[3:] == []  # held until OBSERVE_EVERY settled plain steps
    for _ in range(OBSERVE_EVERY - 1):
        engine.step()
    assert seen[3:] == [("plain", 2)] * OBSERVE_EVERY
    engine.step()
    engine.step()  # two more settled plain steps of {a, b}, held
    engine.abort_request("b")
    engine.step()  # a alone: the held steps go to the policy as {a, b}'s
    assert seen[3 + OBSERVE_EVERY :] == [("plain", 2)] * 2
    for rid in ("a", "b"):
        engine.abort_request(rid)
    assert_pages_free(llm)
