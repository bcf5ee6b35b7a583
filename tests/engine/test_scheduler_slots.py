"""Sequence slots: every running request holds a distinct slot in [0, max_num_seqs), taken at
admission and given back at finish and preemption, and each admission is reported once."""

from __future__ import annotations

import random

from mlaserve.engine.request import RequestStatus
from mlaserve.engine.scheduler import Scheduler
from mlaserve.kv_cache import PageAllocator
from tests.engine.scheduler_requests import make


def test_slots_follow_admission_finish_and_preemption() -> None:
    rng = random.Random(0)
    max_num_seqs = 4
    # Few pages: decodes outgrow them and the newest running request gets preempted.
    sched = Scheduler(PageAllocator(12), page_size=4, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=32)  # fmt: skip
    requests = [make(f"r{i}", rng.randrange(1, 12)) for i in range(30)]
    for r in requests:
        sched.add(r)
    admissions = preemptions = 0
    for _ in range(400):
        if not sched.has_unfinished():
            break
        was_running = {id(r) for r in sched.running}
        out = sched.schedule()
        preemptions += len(out.preempted)
        admissions += len(out.admitted)
        assert {id(r) for r in out.admitted} == {
            id(r) for r in sched.running if id(r) not in was_running
        } - {id(r) for r in out.preempted}
        slots = [r.slot for r in sched.running]
        assert all(s is not None and 0 <= s < max_num_seqs for s in slots)
        assert len(set(slots)) == len(slots)
        assert all(r.slot is None for r in sched.waiting)
        sched.after_step(out)
        for s in out.scheduled:
            if s.samples:
                s.request.output_token_ids.append(7)
                if s.request.num_output_tokens >= 6 or rng.random() < 0.05:
                    sched.finish(s.request)
                    assert s.request.slot is None
    assert not sched.has_unfinished()
    assert all(r.status is RequestStatus.FINISHED and r.slot is None for r in requests)
    assert preemptions > 0 and admissions == len(requests) + preemptions
    # Every slot is free again.
    assert sorted(sched._free_slots) == list(range(max_num_seqs))
