"""The rules of overlap scheduling (mlaserve/engine/overlap.py), one test or more per rule, each
written so that it fails when its rule is broken (checked once by breaking each: see the test's
docstring for what was broken).

CPU copies are synchronous, so the races these rules prevent cannot happen here: the tests check
the mechanism (who waits on what, when) with fences and events they control. The race itself
is reproduced on a GPU by tests/engine/test_overlap_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaserve.config import EngineConfig
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.input_buffers import HostBatch, InputBuffers
from mlaserve.engine.overlap import OverlapError, RowFences, StepFence, StepLedger
from mlaserve.engine.request import Request
from mlaserve.engine.scheduler import Scheduler
from mlaserve.kv_cache import PageAllocator
from mlaserve.llm_engine import LLMEngine
from mlaserve.sampling_params import SamplingParams


def _engine(checkpoint, overlap: bool = True, **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(checkpoint("v3_moe")), device="cpu", dtype="float32", page_size=4,
        max_model_len=256, overlap_schedule=overlap,
        **{"max_num_seqs": 4, "max_num_batched_tokens": 16, **kw},
    )  # fmt: skip
    return LLMEngine(config)


class _FakeEvent:
    """A device event the test completes by hand: `query` is False until `synchronize`."""

    def __init__(self) -> None:
        self.done = True
        self.num_synchronized = 0

    def record(self, stream=None) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.num_synchronized += 1
        self.done = True


# ----- rule 1: at most one step in flight -----


def test_the_ledger_refuses_a_step_while_an_older_one_is_unwaited() -> None:
    """Broken by dropping `launch`'s check: the third launch went through."""
    ledger = StepLedger()
    first = ledger.launch()
    ledger.launch()  # the overlapped next step: two in flight for a moment is the design
    with pytest.raises(OverlapError, match=f"step {first} was never waited on"):
        ledger.launch()
    ledger.waited(first)
    ledger.launch()
    assert ledger.max_in_flight == 2


def test_every_step_that_samples_nothing_is_waited_on_before_the_step_after_next(
    checkpoint, monkeypatch
) -> None:
    """A long prompt alone in chunks of 16 tokens: its chunks sample nothing, so no read-back
    ever waits on them. Each must still be waited on (its fence) before the host launches the
    step after the next one, or the host runs ahead of the device and rewrites staging rows
    whose copies are still queued (issue 40's crash). Broken by returning
    `PendingSample(None, None)` without a fence for such steps (the code before the fix):
    no fence was waited on."""
    for overlap in (True, False):
        engine = _engine(checkpoint, overlap=overlap)
        waited: list[tuple[int, int]] = []  # (fence's step, last launched when waited)
        made = engine.runner.fence

        def fence(engine=engine, made=made, waited=waited) -> StepFence:
            step = engine.ledger.last_launched
            real = made()

            class Recorded(StepFence):
                def wait(self) -> None:
                    waited.append((step, engine.ledger.last_launched))
                    real.wait()

            return Recorded(None)

        monkeypatch.setattr(engine.runner, "fence", fence)
        engine.add_request("long", list(range(1, 101)), SamplingParams(max_tokens=3))
        while engine.has_unfinished_requests():
            engine.step()
        engine.drain()
        chunks = -(-100 // 16) - 1  # every chunk but the last samples nothing
        assert [step for step, _ in waited] == list(range(1, chunks + 1)), overlap
        assert all(last <= step + 1 for step, last in waited), waited
        assert engine.ledger.in_flight == 0 and engine.ledger.max_in_flight <= 2


# ----- rule 2: a staging row is rewritten only after its copy is done -----


def test_row_fences_wait_for_the_last_copy_before_a_row_is_rewritten() -> None:
    """Broken by making `before_write` return at once: the write went ahead while the fake
    copy was still in flight, and no wait was counted."""
    fences = RowFences(2, _FakeEvent)
    fences.before_write(0)  # never copied: nothing to wait for
    fences.after_copy(0)
    fences.before_write(1)
    fences.after_copy(1)
    event = fences._events[0]
    assert not event.query()  # the copy out of row 0 is "in flight"
    fences.before_write(0)
    assert event.num_synchronized == 1 and fences.num_blocking_waits == 1
    event_1 = fences._events[1]
    event_1.done = True  # row 1's copy finished on its own: no blocking wait
    fences.before_write(1)
    assert event_1.num_synchronized == 0 and fences.num_blocking_waits == 1


def test_fill_waits_on_the_row_it_is_about_to_rewrite() -> None:
    """Through `InputBuffers.fill` (on CPU its copies are synchronous, so the test's events
    stand in for the device's). Broken by moving `before_write` after the staging writes: the
    third fill rewrote row 0 before waiting."""
    buffers = InputBuffers(
        max_num_seqs=2, max_num_tokens=8, max_pages_per_seq=4, device=torch.device("cpu")
    )
    buffers.fences = fences = RowFences(2, _FakeEvent)
    order: list[str] = []
    stage = buffers._stage_np[0][0]

    def before_write(row: int, real=fences.before_write) -> None:
        order.append(f"wait {row} with ids[0]={int(stage[0, 0])}")
        real(row)

    fences.before_write = before_write
    real_upload = buffers._upload

    def upload(n_writes: int) -> None:
        real_upload(n_writes)
        fences.after_copy(buffers._turn)  # the CUDA path records here

    buffers._upload = upload
    for step, token in enumerate((7, 8, 9)):
        host = HostBatch(ForwardMode.DECODE, [token], [step], [4], [step + 1], [1], [[1]], [])
        buffers.fill(host, max_seq_len=8, kv_pool=None, attn_backend=None)
    # The third fill waited on row 0 while row 0 still held the first step's token 7.
    assert order == ["wait 0 with ids[0]=0", "wait 1 with ids[0]=7", "wait 0 with ids[0]=7"]
    assert fences.num_blocking_waits == 1


def test_a_page_outside_the_pool_names_its_request() -> None:
    """Broken by dropping the bounds check: the page went to the device."""
    buffers = InputBuffers(
        max_num_seqs=2, max_num_tokens=8, max_pages_per_seq=4, device=torch.device("cpu"),
        num_pages=6,
    )  # fmt: skip
    host = HostBatch(
        ForwardMode.DECODE, [1, 2], [0, 0], [4, 8], [1, 1], [1, 1], [[1], [9]], [],
        table_rows=[0, 1],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"request #1 of the batch: page 9 is outside .* 6 pages"):
        buffers.fill(host, max_seq_len=8, kv_pool=None, attn_backend=None)


# ----- rule 3: at most two read-backs per host wait -----


def test_a_read_back_whose_row_was_reused_before_it_was_read_fails(checkpoint) -> None:
    """Broken by dropping the generation check in `ReadBack.wait`: the first read-back
    returned the third one's values."""
    runner = _engine(checkpoint).runner
    first = runner.start_read_back(torch.tensor([1, 2]))
    second = runner.start_read_back(torch.tensor([3, 4]))
    third = runner.start_read_back(torch.tensor([5, 6]))  # reuses the first's row
    assert second.wait() == [3, 4] and third.wait() == [5, 6]
    with pytest.raises(OverlapError, match="more than two read-backs per host wait"):
        first.wait()


# ----- rule 4: a pending token is read by the step right after the one that sampled it -----


def test_a_pending_token_of_another_step_is_refused_naming_the_request(checkpoint) -> None:
    """Broken by dropping the step check in `build_host_batch`: the batch was built and its
    row would have read the wrong step's tokens."""
    engine = _engine(checkpoint)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    engine.step()  # the prompt, in flight: its first token pending on the device
    inflight = engine._inflight
    assert inflight is not None and inflight.samples
    sched = engine.scheduler.schedule()
    feed = inflight.sample.feed
    engine.runner.build_host_batch(sched, feed, inflight.step)  # the right step: fine
    with pytest.raises(OverlapError, match=r"request r: its pending token was sampled by step"):
        engine.runner.build_host_batch(sched, feed, inflight.step + 1)
    with pytest.raises(OverlapError, match="the step in flight is None"):
        engine.runner.build_host_batch(sched, None, None)


# ----- rule 5: a request whose token is pending is not (re)admitted -----


def _request(rid: str, n: int) -> Request:
    return Request(rid, None, list(range(1, n + 1)), SamplingParams(max_tokens=8), 0, 8)


def test_a_preempted_request_waits_for_its_pending_token() -> None:
    """Two schedules without a read-back in between (what an engine that let two steps be in
    flight would do): the preempted request must not come back before its token resolves.
    Broken by removing the scheduler's pending check: the second schedule admitted it."""
    allocator = PageAllocator(4)  # 3 usable pages of 4 tokens
    scheduler = Scheduler(allocator, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = _request("old", 4), _request("new", 4)
    scheduler.add(old)
    scheduler.add(new)
    out = scheduler.schedule()
    scheduler.after_step(out)
    for r in (old, new):  # both sampled a token, still on the device
        r.num_pending_tokens = 1
    # Each needs a second page now: 4 pages of 3 -> the newest is preempted.
    out = scheduler.schedule()
    assert out.preempted == [new] and [s.request for s in out.scheduled] == [old]
    scheduler.finish(old)  # frees its pages: room for `new` again
    out = scheduler.schedule()
    assert out.admitted == [] and new.num_computed_tokens == 0
    new.num_pending_tokens = 0  # its token reached the host
    new.output_token_ids.append(5)
    out = scheduler.schedule()
    assert out.admitted == [new] and out.scheduled[0].num_new_tokens == 5


# ----- the engine under all of it -----


def test_chunked_prompts_beside_decodes_give_the_same_tokens_with_overlap_on_and_off(
    checkpoint,
) -> None:
    """Steps that sample nothing (chunks alone), then chunks beside decodes, both modes: the
    same greedy tokens, every page back, nothing left in flight."""
    got = {}
    for overlap in (True, False):
        engine = _engine(checkpoint, overlap=overlap)
        rng = np.random.default_rng(0)
        engine.add_request(
            "long", rng.integers(1, 90, 120).tolist(), SamplingParams(max_tokens=6, temperature=0)
        )
        for i in range(3):
            prompt = rng.integers(1, 90, 5 + 7 * i).tolist()
            engine.add_request(f"s{i}", prompt, SamplingParams(max_tokens=10, temperature=0))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = out.outputs[0].token_ids
        engine.drain()
        stats = engine.get_stats()
        assert stats.num_free_pages == stats.num_total_pages
        assert engine.ledger.in_flight == 0
        got[overlap] = tokens
    assert got[True] == got[False]
