"""Tokenization and detokenization off the event loop: one thread, a bounded queue.

Encoding a long prompt, rendering a chat template or decoding a long id list takes milliseconds
to seconds; on the event loop that time is taken from every other request, /health included.
The HTTP handlers therefore hand such work to `TokenizerWorker.run`, which runs it on a single
dedicated thread that owns its own tokenizer (HF fast tokenizers must not be shared between
threads, see mlaserve/tokenizer/tokenizer.py). HF's encode releases the GIL while the Rust side
works, so the loop keeps serving meanwhile.

The queue is bounded: with `max_pending` jobs queued or running, `run` refuses at once with
`TokenizerBusyError` (the service answers 503 + Retry-After) instead of letting waiting work
pile up in memory. A job whose client left still runs to the end (a started encode cannot be
interrupted), but it counts against the bound until it does.

The server sizes the queue to its admission bound, max_num_seqs + max_queue (`AsyncEngine`;
`--tokenizer-queue` overrides it): every request is tokenized before admission counts it, so a
smaller queue refused bursts that admission would take (issue 40). Waiting there is short: the
thread drains even a full queue in seconds (bench/tokenizer_throughput.py; measured:
bench/RESULTS.md, "Moved from mlaserve/service/tokenizer_worker.py"). Encodes are not batched:
HF's batch call gained little there, and a job would then wait for its whole batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from mlaserve.tokenizer import Tokenizer

__all__ = ["TokenizerBusyError", "TokenizerWorker"]

T = TypeVar("T")


class TokenizerBusyError(RuntimeError):
    """`max_pending` tokenizer jobs are already queued or running."""


class TokenizerWorker:
    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self.num_pending = 0  # event-loop side only
        self._tokenizer: Tokenizer | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mlaserve-tokenizer"
        )

    def bind(self, tokenizer: Tokenizer) -> None:
        """Give the worker its own tokenizer (a copy nobody else calls)."""
        self._tokenizer = tokenizer

    async def run(self, fn: Callable[[Tokenizer], T]) -> T:
        """`fn(tokenizer)` on the worker thread. Raises TokenizerBusyError when full."""
        if self._tokenizer is None:
            raise RuntimeError("the tokenizer is not loaded yet")
        if self.num_pending >= self.max_pending:
            raise TokenizerBusyError(
                f"the tokenizer is busy ({self.num_pending} requests queued, limit "
                f"{self.max_pending}); retry later"
            )
        loop = asyncio.get_running_loop()
        self.num_pending += 1
        future = self._executor.submit(fn, self._tokenizer)
        # Counted until the job really ends, even when the awaiting request is cancelled.
        future.add_done_callback(lambda _: self._call_soon(loop, self._done))
        return await asyncio.wrap_future(future)

    def _done(self) -> None:
        self.num_pending -= 1

    @staticmethod
    def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody counts any more
            loop.call_soon_threadsafe(fn)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
