"""`ModelRunner.build_host_batch`: the token rows of a step (ids, positions, KV write slots, in
scheduling order) equal a row-by-row construction, as lists for decodes alone and as int64
arrays once a prompt chunk is in the batch, whichever order decodes and chunks come in."""

from __future__ import annotations

import numpy as np
import pytest

from mlaserve import SamplingParams
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.token_rows import TokenRows as _TokenRows

PAGE = 4


@pytest.fixture(scope="module")
def engine(small_engine):
    assert small_engine.config.page_size == PAGE
    return small_engine


def _expected(sched) -> tuple[list[int], list[int], list[int]]:
    ids, positions, slots = [], [], []
    for s in sched.scheduled:
        r, start = s.request, s.request.num_computed_tokens
        for p in range(start, start + s.num_new_tokens):
            ids.append(r.token_at(p))
            positions.append(p)
            slots.append(r.pages[p // PAGE] * PAGE + p % PAGE)
    return ids, positions, slots


def _add(engine, rid: str, n: int, max_tokens: int = 8) -> None:
    prompt = [(7 * i + len(rid)) % 100 + 1 for i in range(n)]
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))


@pytest.mark.parametrize("order", ["decodes-then-chunk", "decodes-then-chunks", "decodes-alone"])
def test_token_rows_equal_a_row_by_row_build(engine, order: str) -> None:
    runner = engine.runner
    try:
        if order != "decodes-alone":
            _add(engine, "a", 5)
        _add(engine, "b", 3)
        engine.step()  # their prefill
        engine.drain()  # their tokens on the host: no row reads the device
        if order != "decodes-alone":
            _add(engine, "long", 45)  # pages 0..11 of PAGE 4, a chunk past several pages
        if order == "decodes-then-chunks":
            _add(engine, "short", 6)
        sched = engine.scheduler.schedule()
        host = runner.build_host_batch(sched)
        ids, positions, slots = _expected(sched)
        assert [len(x) for x in (host.input_ids, host.positions, host.slot_mapping)] == [
            len(ids)
        ] * 3
        assert list(host.input_ids) == ids
        assert list(host.positions) == positions
        assert list(host.slot_mapping) == slots
        chunk = any(s.num_new_tokens > 1 for s in sched.scheduled)
        rows = (host.input_ids, host.positions, host.slot_mapping)
        if chunk:
            assert sched.mode is ForwardMode.EXTEND
            assert all(isinstance(x, np.ndarray) and x.dtype == np.int64 for x in rows)
        else:
            assert all(isinstance(x, list) for x in rows)
        # the sampled rows are each sequence's last row
        ends = np.cumsum([s.num_new_tokens for s in sched.scheduled]) - 1
        assert host.logits_indices == [
            int(e) for e, s in zip(ends, sched.scheduled, strict=True) if s.samples
        ]
    finally:
        for rid in list(engine.requests):
            engine.abort_request(rid)


def test_decode_rows_after_a_chunk_keep_their_place() -> None:
    rows = _TokenRows()
    rows.add_one(11, 7, 30)
    rows.add_range([1, 2, 3, 4, 5], 6, [9, 2, 8], 4)  # positions 6..10 over pages 2, 8 (of 3)
    rows.add_one(12, 3, 41)
    rows.add_range([6, 7], 0, [5], 4)
    ids, positions, slots = rows.rows()
    assert rows.count == 9
    assert ids.tolist() == [11, 1, 2, 3, 4, 5, 12, 6, 7]
    assert positions.tolist() == [7, 6, 7, 8, 9, 10, 3, 0, 1]
    assert slots.tolist() == [30, 2 * 4 + 2, 2 * 4 + 3, 8 * 4, 8 * 4 + 1, 8 * 4 + 2, 41, 20, 21]
