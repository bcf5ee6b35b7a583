"""The engine process's messages, read on the event loop itself: a step's outputs reach the
`RequestStream`s that own them without a thread hop or a GIL hand-off.

`loop.add_reader` on the output pipe; `FrameReader` reassembles the frames and never blocks
(uvloop makes that descriptor non-blocking). Never `recv_bytes`, which fails halfway through a
message larger than the pipe's buffer on such a descriptor.
"""

from __future__ import annotations

import asyncio
import pickle
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

from mlaserve.service.pipe_frames import FrameReader

__all__ = ["EngineInbox"]


class EngineInbox:
    """Reads `outputs` (this side's end of the engine's output pipe; owned: `close` closes it)
    on `loop`. Each message goes, unpickled, to `on_message`; at EOF, the messages read before
    it first (a FAILED names the cause), then `on_eof`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        outputs: Connection,
        on_message: Callable[[tuple], None],
        on_eof: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._outputs: Connection | None = outputs
        self._frames: FrameReader | None = FrameReader(outputs.fileno())  # reassembled
        self._inbox: deque[bytes] = deque()  # read, not yet handled
        self._handle_scheduled = False
        self._on_message = on_message
        self._on_eof = on_eof
        loop.add_reader(outputs.fileno(), self._on_readable)

    def close(self) -> None:
        if self._outputs is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._outputs.fileno())
            self._outputs.close()
            self._outputs = None
            self._frames = None

    def _on_readable(self) -> None:
        """One read of the pipe; the messages it completed join the inbox, handled one per loop
        iteration."""
        frames = self._frames
        if frames is None:
            return
        try:
            self._inbox.extend(frames.read())
        except (EOFError, OSError):
            while self._inbox:  # what it sent before it went (a FAILED names the cause)
                self._on_message(pickle.loads(self._inbox.popleft()))
            self._on_eof()
            return
        if not self._handle_scheduled:
            self._handle_one()

    def _handle_one(self) -> None:
        """The oldest unhandled message; the next after the loop's other ready callbacks (the
        streams this one woke), as when each readiness callback read one message: a stream's
        tokens then leave as they come, not several steps to a chunk."""
        self._handle_scheduled = False
        if self._outputs is None:  # closed: nobody waits for what is left
            self._inbox.clear()
            return
        if self._inbox:
            self._on_message(pickle.loads(self._inbox.popleft()))
        if self._inbox:
            self._handle_scheduled = True
            self._loop.call_soon(self._handle_one)
