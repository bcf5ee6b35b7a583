"""The forward mode is stated by the scheduler, from what it scheduled: EXTEND for anything that
carries prompt (or recomputed) tokens, DECODE only when every request decodes one token. A lone
prefill chunk of any length must never be called DECODE (it reached FlashMLA's decode kernel
once, and a 1000-token prompt crashed the GPU engine)."""

from __future__ import annotations

from mlaserve import SamplingParams
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.request import Request
from mlaserve.engine.scheduler import Scheduler
from mlaserve.kv_cache import PageAllocator


def request(rid: str, prompt_len: int) -> Request:
    return Request(rid, None, list(range(prompt_len)), SamplingParams(max_tokens=8), 0, 8)


def scheduler(budget: int = 64, pages: int = 64) -> Scheduler:
    return Scheduler(
        PageAllocator(pages), page_size=4, max_num_seqs=8, max_num_batched_tokens=budget
    )


def run_step(s: Scheduler, sampled: int = 1):
    out = s.schedule()
    s.after_step(out)
    for x in out.scheduled:
        if x.samples:
            x.request.output_token_ids.append(sampled)
    return out


def test_lone_prompts_of_any_length_are_extend() -> None:
    for n in (1, 2, 3, 64, 300, 1000):
        s = scheduler(budget=2048, pages=1024)
        s.add(request("a", n))
        assert s.schedule().mode is ForwardMode.EXTEND, n


def test_equal_length_prompts_are_still_extend() -> None:
    s = scheduler()
    s.add(request("a", 5))
    s.add(request("b", 5))
    assert s.schedule().mode is ForwardMode.EXTEND


def test_decode_then_mixed_then_decode() -> None:
    s = scheduler()
    s.add(request("a", 5))
    assert run_step(s).mode is ForwardMode.EXTEND
    assert run_step(s).mode is ForwardMode.DECODE
    s.add(request("b", 1))  # a 1-token prompt is prompt work too
    assert run_step(s).mode is ForwardMode.EXTEND
    assert run_step(s).mode is ForwardMode.DECODE


def test_chunked_prefill_tail_of_one_token_is_extend() -> None:
    """A 9-token prompt under a budget of 4: chunks 4, 4, 1; the last chunk is one token that
    samples, but it is a prompt token."""
    s = scheduler(budget=4)
    s.add(request("a", 9))
    modes = [run_step(s).mode for _ in range(4)]
    assert modes == [ForwardMode.EXTEND] * 3 + [ForwardMode.DECODE]


def test_recomputation_after_preemption_is_extend() -> None:
    s = scheduler(budget=64, pages=4)  # 3 usable pages of 4 tokens
    a, b = request("a", 4), request("b", 3)
    s.add(a)
    s.add(b)
    preempted = []
    for _ in range(4):
        preempted += run_step(s).preempted
    assert preempted == [b] and b.num_computed_tokens == 0 and b.num_output_tokens > 0
    s.finish(a)  # frees its pages: b comes back with its prompt and its one output token
    out = s.schedule()
    assert [x.request for x in out.scheduled] == [b]
    assert out.scheduled[0].num_new_tokens == b.num_tokens > 1
    assert out.mode is ForwardMode.EXTEND
