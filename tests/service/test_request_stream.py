"""The per-request output queue: bounded by coalescing, whatever the reader's speed (issue 13)."""

from __future__ import annotations

import asyncio

from mlaserve.outputs import CompletionOutput, Logprob, RequestOutput
from mlaserve.service.async_engine import EngineDeadError
from mlaserve.service.request_stream import DeltaAccumulator, RequestStream


def _delta(rid: str, token: int, text: str, finished: bool = False) -> RequestOutput:
    c = CompletionOutput(
        index=0,
        text=text,
        token_ids=[token],
        logprobs=[{token: Logprob(-0.5, 1, text)}],
        finish_reason="length" if finished else None,
    )
    return RequestOutput(rid, None, [1], [c], finished=finished, num_new_tokens=1, new_text=text)


def test_a_reader_that_falls_behind_holds_one_merged_entry_per_request() -> None:
    async def scenario() -> list[RequestOutput]:
        stream = RequestStream(["a", "b"])
        for i in range(10_000):  # the engine runs on; nobody reads
            stream.put(_delta("a", i, f"<{i}>"))
            stream.put(_delta("b", -i, "x", finished=i == 9_999))
            assert stream.num_pending <= 2  # bounded: one entry per engine request
        stream.put(_delta("a", 10_000, "end", finished=True))
        return [out async for out in stream]

    a, b = asyncio.run(scenario())
    assert a.request_id == "a" and a.finished and a.num_new_tokens == 10_001
    assert a.outputs[0].token_ids == list(range(10_001))
    assert a.new_text == a.outputs[0].text == "".join(f"<{i}>" for i in range(10_000)) + "end"
    assert [next(iter(e)) for e in a.outputs[0].logprobs] == list(range(10_001))
    assert b.finished and b.outputs[0].text == "x" * 10_000


def test_a_prompt_reader_gets_every_delta_as_it_comes() -> None:
    async def scenario() -> list[str]:
        stream = RequestStream(["a"])
        seen = []

        async def produce() -> None:
            for i in range(5):
                stream.put(_delta("a", i, str(i), finished=i == 4))
                await asyncio.sleep(0)  # the reader runs between puts

        task = asyncio.ensure_future(produce())
        async for out in stream:
            seen.append(out.new_text)
        await task
        return seen

    assert asyncio.run(scenario()) == ["0", "1", "2", "3", "4"]


def test_pending_outputs_come_before_an_error() -> None:
    async def scenario() -> tuple[list[str], BaseException | None]:
        stream = RequestStream(["a"])
        stream.put(_delta("a", 1, "x"))
        stream.put(EngineDeadError("gone"))
        seen: list[str] = []
        try:
            async for out in stream:
                seen.append(out.new_text)
        except EngineDeadError as e:
            return seen, e
        return seen, None

    seen, error = asyncio.run(scenario())
    assert seen == ["x"] and isinstance(error, EngineDeadError)


def test_accumulator_assembles_the_whole_output_once() -> None:
    acc = DeltaAccumulator(_delta("a", 0, "he"))
    acc.add(_delta("a", 1, ""))  # a token inside a multi-byte character: no text yet
    acc.add(_delta("a", 2, "llo", finished=True))
    out = acc.build()
    assert out.outputs[0].text == "hello" and out.outputs[0].token_ids == [0, 1, 2]
    assert out.finished and out.outputs[0].finish_reason == "length" and out.num_new_tokens == 3
