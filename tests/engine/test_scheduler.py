"""Scheduler policy on the host alone: budgets, chunking, admission by pages, preemption."""

from __future__ import annotations

from mlaserve.engine.request import RequestStatus
from mlaserve.engine.scheduler import Scheduler
from mlaserve.kv_cache import PageAllocator
from tests.engine.scheduler_requests import make


def run_step(sched: Scheduler):
    """Schedule, pretend the forward ran, and sample a token where the scheduler said so."""
    out = sched.schedule()
    samplers = [s.request for s in out.scheduled if s.samples]
    sched.after_step(out)
    for r in samplers:
        r.output_token_ids.append(7)
    return out


def test_chunked_prefill_respects_budget_and_decodes_go_first() -> None:
    sched = Scheduler(PageAllocator(100), page_size=4, max_num_seqs=8, max_num_batched_tokens=10)
    a = make("a", 3)
    sched.add(a)
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("a", 3, True)
    ]
    b = make("b", 25)
    sched.add(b)
    out = run_step(sched)  # a decodes (1), b gets the remaining 9 tokens of the budget
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    assert not out.scheduled[1].samples
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("a", 1, True),
        ("b", 7, True),
    ]
    assert b.num_computed_tokens == 25 and b.num_output_tokens == 1
    assert len(b.pages) == 7  # ceil(25 / 4)


def test_admission_waits_for_pages_and_seq_slots() -> None:
    alloc = PageAllocator(4)  # 3 usable pages of 4 tokens
    sched = Scheduler(alloc, page_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    for rid, n in (("a", 8), ("b", 4), ("c", 1)):
        sched.add(make(rid, n))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]  # c: no seq slot
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_preempts_newest_and_recomputes() -> None:
    alloc = PageAllocator(4)  # 3 usable pages of 2 tokens
    sched = Scheduler(alloc, page_size=2, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make("a", 2), make("b", 2)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a, b each hold 1 page and sampled a token (3 tokens each now)
    out = run_step(sched)  # a needs a 2nd page (ok: 1 free), b needs one too: none left
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert out.preempted == [b]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and not b.pages
    assert sched.waiting[0] is b and b.num_output_tokens == 1
    sched.finish(a)
    out = run_step(sched)  # b comes back: prompt + its generated token are recomputed
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("b", 3, True)
    ]
    sched.finish(b)
    assert alloc.num_free_pages == alloc.num_usable_pages


def test_oldest_request_preempts_itself_when_alone_cannot_grow() -> None:
    alloc = PageAllocator(2)  # one usable page of 2 tokens
    sched = Scheduler(alloc, page_size=2, max_num_seqs=4, max_num_batched_tokens=64)
    a = make("a", 2)
    sched.add(a)
    run_step(sched)
    out = run_step(sched)
    assert out.scheduled == [] and out.preempted == [a]
    assert alloc.num_free_pages == 1


def test_lookahead_pages_are_reserved_before_the_step_and_count_in_admission() -> None:
    # Speculation with k = 2 writes up to 2k = 4 slots past a decode's own token.
    sched = Scheduler(
        PageAllocator(5), page_size=4, max_num_seqs=8, max_num_batched_tokens=64,
        num_lookahead_tokens=4,
    )  # fmt: skip
    a, b = make("a", 5), make("b", 5)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    # a: 5 prompt tokens + 4 lookahead = 9 slots = 3 pages; b would need 3 of the 1 left.
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert len(a.pages) == 3 and b.status is RequestStatus.WAITING
    # A decode (1 token) reserves its lookahead too: 5 computed + 1 + 4 = 10 -> still 3 pages.
    out = sched.schedule()
    assert out.scheduled[0].is_decode and len(a.pages) == 3
    # The verify step accepted 2 drafts: they were computed too.
    sched.after_step(out, num_accepted=[2])
    assert a.num_computed_tokens == 5 + 1 + 2


def test_batch_id_is_the_same_exactly_when_the_batch_is() -> None:
    """`SchedulerOutput.batch_id`: two outputs in a row with the same id schedule the same
    requests in the same order, and a steady decode batch keeps its id (what the speculative
    decoder's plain fast path relies on). Random arrivals, finishes, aborts, preemptions (few
    pages), budgets that leave requests out, and running requests skipped for a pending last
    token (overlap scheduling)."""
    import random

    rng = random.Random(0)
    for trial in range(20):
        sched = Scheduler(
            PageAllocator(rng.choice([12, 40, 200])),
            page_size=4,
            max_num_seqs=rng.choice([2, 4, 8]),
            max_num_batched_tokens=rng.choice([6, 16, 64]),
        )
        prev, kept = None, 0
        for step in range(60):
            if rng.random() < 0.2:
                sched.add(make(f"{trial}-{step}", rng.randint(1, 12)))
            running = [r for r in sched.running if not r.is_finished]
            if running and rng.random() < 0.1:
                sched.finish(rng.choice(running))  # finished or aborted
            skipped = None
            if running and rng.random() < 0.1:  # its last token still on the device
                skipped = rng.choice([r for r in running if not r.is_finished] or [None])
                if skipped is not None:
                    skipped.max_tokens, skipped.num_pending_tokens = skipped.num_output_tokens, 1
            out = run_step(sched)
            if skipped is not None:
                skipped.num_pending_tokens = 0
                sched.finish(skipped)
            batch = [s.request for s in out.scheduled]
            if prev is not None and out.batch_id == prev[0]:
                assert batch == prev[1] and all(a is b for a, b in zip(batch, prev[1]))
                kept += 1
            prev = (out.batch_id, batch)
    assert kept >= 20  # and steady stretches keep their id (40 with this seed)


def test_a_steady_decode_batch_keeps_its_id() -> None:
    sched = Scheduler(PageAllocator(100), page_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    for rid in "ab":
        sched.add(make(rid, 3))
    ids = [run_step(sched).batch_id for _ in range(4)]
    assert ids[0] == ids[1] == ids[2] == ids[3]  # the prefill, then the same two decoding
    sched.add(make("c", 3))
    assert run_step(sched).batch_id != ids[0]  # an arrival
    again = run_step(sched).batch_id
    sched.finish(sched.running[0])
    assert run_step(sched).batch_id != again  # a finish


def test_a_batch_left_short_then_whole_again_gets_a_new_id() -> None:
    """A step that leaves a running request out (here: its last token pending on the device)
    and the next, which schedules it again with nothing else changed, are different batches."""
    sched = Scheduler(PageAllocator(100), page_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    for rid in "ab":
        sched.add(make(rid, 3))
    whole = run_step(sched).batch_id
    b = sched.running[1]
    max_tokens, b.max_tokens, b.num_pending_tokens = b.max_tokens, b.num_output_tokens, 1
    short = run_step(sched)
    assert [s.request.request_id for s in short.scheduled] == ["a"] and short.batch_id != whole
    b.max_tokens, b.num_pending_tokens = max_tokens, 0
    again = run_step(sched)
    assert len(again.scheduled) == 2 and again.batch_id != short.batch_id
