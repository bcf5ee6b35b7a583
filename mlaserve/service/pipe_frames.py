"""Messages from the engine process's pipe, reassembled on the event loop without blocking.

The engine writes with `Connection.send_bytes`: a 4-byte big-endian signed length (or -1 and an
8-byte length past 2 GiB), then the payload, the payload in a separate write once it is over
16 KiB. A message larger than the pipe's buffer (64 KiB on Linux: a step's prompt logprobs over
a long prompt) therefore reaches the reader in several pieces, the writer blocked in between.

`Connection.recv_bytes` assumes a blocking descriptor. uvloop's `add_reader` (libuv's
`uv_poll_init`) makes it non-blocking, so a `recv_bytes` that started on the first piece raised
`BlockingIOError` on the second; the frontend took that for the engine's death, closed its end,
and the engine died of a broken pipe (found by bench/soak.py: bench/RESULTS.md, "Death 2"; the
asyncio loop the CPU tests run keeps descriptors blocking, so they never saw it). `FrameReader`
does one `os.read` per readiness callback, which never blocks in either mode, and hands back
every message completed so far.
"""

from __future__ import annotations

import os
import struct

__all__ = ["FrameReader"]

READ_BYTES = 1 << 20  # per readiness callback: a big message in a few reads, a small one in one


class FrameReader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()

    def read(self) -> list[bytes]:
        """One read of what the pipe holds -> the messages it completed (maybe none). Raises
        EOFError when the writer is gone (its end closed): at a message boundary, or mid-message
        (a writer that died while writing)."""
        try:
            chunk = os.read(self.fd, READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return []  # readiness was spurious: nothing yet
        if not chunk:
            raise EOFError("the engine's pipe closed" + (" mid-message" if self._buf else ""))
        buf = self._buf
        buf += chunk
        messages: list[bytes] = []
        start = 0
        while len(buf) - start >= 4:
            (size,) = struct.unpack_from("!i", buf, start)
            head = 4
            if size == -1:
                if len(buf) - start < 12:
                    break
                (size,) = struct.unpack_from("!Q", buf, start + 4)
                head = 12
            end = start + head + size
            if len(buf) < end:
                break
            messages.append(bytes(buf[start + head : end]))
            start = end
        if start:
            del buf[:start]
        return messages
