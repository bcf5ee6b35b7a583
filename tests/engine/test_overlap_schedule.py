"""Overlap scheduling (`EngineConfig.overlap_schedule`): a step is launched before the previous
step's tokens reach the host, and its decode rows take those tokens on the device.

It must change nothing but timing: the same requests give the same tokens, texts, finish reasons
and logprobs with it on and off, through batches that grow, shrink, stop mid-flight (EOS, stop
ids, stop strings, max_tokens), get preempted, and mix in requests that cannot overlap
(logprobs, prompt logprobs). The engine runs on CPU here, the same code path as on CUDA (where
it is on by default); tests/engine/test_engine_gpu.py repeats the comparison on the GPU.
"""

from __future__ import annotations

import pytest

from mlaserve.config import EngineConfig
from mlaserve.llm_engine import LLMEngine
from mlaserve.sampling_params import RequestOutputKind, SamplingParams
from tests.device_ops import DeviceOps, uncounted

STREAM = RequestOutputKind.DELTA


def _engine(checkpoint, overlap: bool, **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(checkpoint("v3_moe")), device="cpu", dtype="float32", page_size=4,
        max_model_len=128, overlap_schedule=overlap, **{"max_num_seqs": 4, **kw},
    )  # fmt: skip
    return LLMEngine(config)


def _requests(stop_id: int) -> list[tuple[list[int], SamplingParams]]:
    """16 requests: more than max_num_seqs (admissions mid-stream), ragged prompts, greedy and
    seeded sampling with penalties, stops of every kind, logprobs and prompt logprobs."""
    out = []
    for i in range(16):
        prompt = [(5 * i + 3 * j) % 97 + 1 for j in range(3 + (i * 7) % 23)]
        kw: dict = {"max_tokens": 4 + (i * 5) % 17, "output_kind": STREAM}
        if i % 3 == 1:
            kw.update(temperature=0.9, top_k=20, seed=100 + i, repetition_penalty=1.2)
        elif i % 3 == 2:
            kw.update(temperature=0.7, top_p=0.9, seed=200 + i, frequency_penalty=0.5)
        else:
            kw.update(temperature=0.0)
        if i % 4 == 0:
            kw.update(stop_token_ids=[stop_id])
        if i % 5 == 3:
            kw.update(stop=["e"], min_tokens=2)
        if i == 6:
            kw.update(logprobs=2)
        if i == 9:
            kw.update(prompt_logprobs=1)
        if i == 11:
            kw.update(ignore_eos=True, max_tokens=30)
        out.append((prompt, SamplingParams(**kw)))
    return out


def _run(engine: LLMEngine, requests, abort_at: dict[str, int] | None = None) -> dict:
    """Add the requests in two waves, step to the end; per request: (token ids, text, finish
    reason, logprobs, prompt logprobs), from the streamed deltas."""
    got: dict[str, list] = {}
    waves = [requests[:10], requests[10:]]
    steps = 0
    for wave, batch in enumerate(waves):
        for i, (prompt, params) in enumerate(batch):
            rid = f"w{wave}-{i}"
            engine.add_request(rid, prompt, params)
            got[rid] = [[], "", None, [], None]
        for _ in range(3 if wave == 0 else 10**6):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                entry = got[out.request_id]
                c = out.outputs[0]
                entry[0] += c.token_ids
                entry[1] += c.text
                entry[2] = c.finish_reason
                entry[3] += c.logprobs or []
                if out.prompt_logprobs is not None:
                    entry[4] = out.prompt_logprobs
            steps += 1
            for rid, at in (abort_at or {}).items():
                if steps == at:
                    engine.abort_request(rid)
    return got


def _close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].rank == b[t].rank
                assert abs(a[t].logprob - b[t].logprob) <= 1e-4


def _stop_id(checkpoint) -> int:
    """A token greedy decoding of the first prompt emits at its third step (so stop ids hit)."""
    engine = _engine(checkpoint, overlap=False)
    prompt, _ = _requests(0)[0]
    engine.add_request("probe", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    return tokens[-1]


@pytest.mark.parametrize("num_pages", [None, 14])  # 14 pages of 4 tokens: preemptions
def test_outputs_equal_with_overlap_on_and_off(checkpoint, num_pages) -> None:
    requests = _requests(_stop_id(checkpoint))
    off = _engine(checkpoint, overlap=False, num_pages=num_pages)
    on = _engine(checkpoint, overlap=True, num_pages=num_pages)
    assert not off.overlap and on.overlap
    want, got = _run(off, requests), _run(on, requests)
    assert got.keys() == want.keys()
    for rid in want:
        tokens, text, reason, logprobs, prompt_logprobs = got[rid]
        assert (tokens, text, reason) == tuple(want[rid][:3]), rid
        # Batches differ in size and order between the two runs, and fp32 sums with them: the
        # same logprobs to 1e-4.
        _close(logprobs, want[rid][3])
        _close(prompt_logprobs or [], want[rid][4] or [])
    reasons = {entry[2] for entry in want.values()}
    assert {"stop", "length"} <= reasons  # stops of both kinds happened mid-flight
    if num_pages is not None:
        assert on.scheduler.num_preemptions > 0
    for engine in (off, on):
        stats = engine.get_stats()
        assert not engine.has_unfinished_requests() and engine.requests == {}
        assert stats.num_free_pages == stats.num_total_pages  # nothing leaked


def test_a_steady_decode_step_launches_before_it_reads_back(checkpoint) -> None:
    """The step returns the previous step's tokens while its own are in flight, and its input
    ids come from the device in one copy: the synchronous step's nine ops plus that copy."""
    engine = _engine(checkpoint, overlap=True)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, output_kind=STREAM)
    for i in range(3):
        engine.add_request(f"r{i}", [1 + i, 2, 3, 4, 5], greedy)
    for _ in range(5):
        engine.step()
    runner = engine.runner
    runner.forward_with_hidden = uncounted(runner.forward_with_hidden)
    waits = runner.num_host_waits
    try:
        with DeviceOps() as counted:
            outputs = engine.step()
    finally:
        del runner.forward_with_hidden
    assert runner.num_host_waits == waits + 1  # the previous step's tokens, nothing else
    assert len(outputs) == 3 and all(o.num_new_tokens == 1 for o in outputs)
    inflight = engine._inflight
    assert (
        inflight is not None
        and [r.num_pending_tokens for r in inflight.scheduled.sampled_requests] == [1] * 3
    )
    assert dict(counted.ops) == {
        "copy_": 4,  # token rows, length rows, the previous tokens as input ids, the read-back
        "index_select": 1,
        "argmax": 1,
        "gather": 1,
        "isfinite": 1,
        "where": 1,
    }
    while engine.has_unfinished_requests():
        engine.step()
    assert engine._inflight is None


def test_aborts_while_a_step_is_in_flight_leak_nothing(checkpoint) -> None:
    requests = _requests(_stop_id(checkpoint))
    engine = _engine(checkpoint, overlap=True)
    got = _run(engine, requests, abort_at={"w0-1": 2, "w0-2": 4, "w1-0": 6})
    assert got["w0-1"][2] is None and got["w0-2"][2] is None  # aborted: no final output
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests() and engine.requests == {}
    assert stats.num_free_pages == stats.num_total_pages
    # Aborting everything mid-flight: the step in flight is dropped by the next step.
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"a{i}", [7, 8, 9 + i], params)
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    for i in range(3):
        engine.abort_request(f"a{i}")
    assert not engine.has_unfinished_requests()
    engine.add_request("after", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "after"
            tokens = out.outputs[0].token_ids
    assert len(tokens) == 3
    stats = engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages


def test_max_tokens_ends_without_a_step_past_it(checkpoint) -> None:
    """A request whose pending token is its last is not scheduled again: a one-token request
    takes one forward, a three-token one three."""
    engine = _engine(checkpoint, overlap=True)
    for max_tokens in (1, 3):
        before = engine.num_steps
        engine.add_request(f"m{max_tokens}", [4, 5, 6], SamplingParams(max_tokens=max_tokens))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.num_steps == before + max_tokens


def test_a_synchronous_step_after_an_overlapped_one_drops_what_ended(checkpoint) -> None:
    """An overlapped step is in flight when the next step is scheduled; if that next step cannot
    overlap (a logprobs request arrives), the in-flight tokens are read back first, and a
    request they end (a stop id) has released its pages: the step goes on without it. Outputs
    equal overlap off's, no page is left held."""
    prompts = [[(5 * i + 3 * j) % 97 + 1 for j in range(4 + i)] for i in range(6)]
    greedy = dict(temperature=0.0, output_kind=STREAM)

    def run(engine: LLMEngine, stops: list[int] | None) -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            ids = [stops[i]] if stops else None
            engine.add_request(
                f"s{i}", p, SamplingParams(max_tokens=12, stop_token_ids=ids, **greedy)
            )
        step = 0
        while engine.has_unfinished_requests():
            if stops and step % 2 == 1:  # every other step: a request that cannot overlap
                lp = SamplingParams(max_tokens=1, logprobs=1, **greedy)
                engine.add_request(f"lp{step}", [7, 8, 9], lp)
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            step += 1
        return {rid: t for rid, t in got.items() if rid.startswith("s")}

    # each request stops at a token of its own greedy continuation, at steps 3..8
    free = run(_engine(checkpoint, overlap=False), None)
    stops = [free[f"s{i}"][2 + i] for i in range(len(prompts))]
    want = run(_engine(checkpoint, overlap=False), stops)
    on = _engine(checkpoint, overlap=True)
    assert run(on, stops) == want
    assert sum(len(want[f"s{i}"]) < 12 for i in range(len(prompts))) >= 4  # stops happened
    stats = on.get_stats()
    assert stats.num_free_pages == stats.num_total_pages
