"""EngineInbox: messages handled one per loop iteration, in order; closing drops the rest."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

from mlaserve.service.engine_inbox import EngineInbox


def _run(closing_after: int | None) -> tuple[list[tuple], EngineInbox]:
    loop = asyncio.new_event_loop()
    reader, writer = mp.Pipe(duplex=False)
    got: list[tuple] = []
    inbox: EngineInbox

    def on_message(msg: tuple) -> None:
        got.append(msg)
        if closing_after is not None and len(got) == closing_after:
            inbox.close()

    inbox = EngineInbox(loop, reader, on_message, on_eof=lambda: None)
    for i in range(5):
        writer.send(("step", i))

    async def settle() -> None:
        for _ in range(50):  # loop iterations: more than the messages need
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        for _ in range(50):
            await asyncio.sleep(0)

    try:
        loop.run_until_complete(settle())
    finally:
        inbox.close()
        writer.close()
        loop.close()
    return got, inbox


def test_messages_arrive_in_order() -> None:
    got, _ = _run(closing_after=None)
    assert got == [("step", i) for i in range(5)]


def test_closing_with_messages_queued_stops_handling() -> None:
    # Before: a closed inbox with queued messages rescheduled itself on every loop iteration.
    got, inbox = _run(closing_after=2)
    assert got == [("step", 0), ("step", 1)]
    assert not inbox._handle_scheduled and not inbox._inbox
