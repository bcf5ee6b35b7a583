"""The server's side of the engine process: requests in, `RequestStream`s out, on the event loop.

`LLMEngine` runs in its own process (`engine_core.py`), started with `spawn`, so the HTTP side's
per-token work (routing outputs, SSE framing, uvicorn) runs in parallel with the engine's steps
instead of sharing one GIL with them (vLLM V1's AsyncLLM + EngineCore split). This side loads its
own tokenizer (for the tokenizer worker) while the engine process loads the weights.

The engine's messages are read on the event loop itself (`EngineInbox`): a step's outputs are
routed to the `RequestStream` of the HTTP request that owns them without a thread hop.

If the engine process dies (it raised and sent FAILED, or it was killed: the pipe reaches EOF,
read on the loop as soon as it happens), every in-flight stream raises `EngineDeadError`,
/health turns 503 and `on_fatal` is called (the CLI then exits 1 so that an orchestrator restarts
the server; `shutdown` kills a dead engine's process at once rather than wait for it).

Shutdown: `begin_drain` (SIGTERM) stops admitting and arms a `shutdown_timeout` deadline; what is
still running then is aborted and its streams raise `ServerShutdownError`, so that every open
response ends on its own terms (an SSE error event and `[DONE]`, or a 503 body) before uvicorn's
own, later, graceful-shutdown timeout would cut the connections. `shutdown` stops the engine
process (killing it if it does not stop in time); an exit hook kills it if the server exits any
other way, and the engine process exits by itself when this process vanishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlaserve.service import engine_core as core
from mlaserve.service.engine_errors import (
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    ServerShutdownError,
)
from mlaserve.service.engine_process import EngineProcess, SpawnedEngine
from mlaserve.service.metrics import Metrics
from mlaserve.service.output_wire import decode_outputs
from mlaserve.service.request_stream import RequestStream, SubRequest
from mlaserve.service.tokenizer_worker import TokenizerWorker

if TYPE_CHECKING:
    from mlaserve.config import EngineConfig
    from mlaserve.llm_engine import LLMEngine
    from mlaserve.outputs import RequestOutput
    from mlaserve.tokenizer import Tokenizer

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineNotReadyError",
    "EngineState",
    "QueueFullError",
    "RequestStream",
    "ServerShutdownError",
    "SubRequest",
]

logger = logging.getLogger("mlaserve.service")


class EngineState(enum.StrEnum):
    STARTING = "starting"  # process not started yet
    LOADING = "loading"  # loading weights
    WARMING_UP = "warming_up"  # warm-up: dummy steps, kernel compilation, graph capture
    READY = "ready"
    DRAINING = "draining"  # shutting down: no new requests, in-flight ones go on
    STOPPED = "stopped"
    DEAD = "dead"  # the engine process raised or vanished


class AsyncEngine:
    """The engine process, driven from the event loop.

    `engine_factory` (tests inject faults with it) is called in the engine process, so it must
    be picklable: a module-level function or a `functools.partial` of one.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        max_queue: int,
        metrics: Metrics | None = None,
        engine_factory: Callable[[EngineConfig], LLMEngine] | None = None,
        on_load_error: Callable[[BaseException], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        shutdown_timeout: float = 30.0,
        tokenizer_queue: int | None = None,
        torch_threads: int | None = None,
        spawned: SpawnedEngine | None = None,
    ) -> None:
        self.config = config
        self._spawned = spawned  # an engine process already started (`spawn_engine`), or None
        self.max_queue = max_queue
        self.shutdown_timeout = shutdown_timeout
        self.tokenizer_worker = TokenizerWorker(
            tokenizer_queue if tokenizer_queue is not None else self.admission_bound
        )
        self.torch_threads = torch_threads  # set in the engine process
        self.metrics = metrics if metrics is not None else Metrics()
        self._engine_factory = engine_factory
        self._on_load_error = on_load_error
        self._on_fatal = on_fatal
        self._drain_deadline: asyncio.TimerHandle | None = None
        self.state = EngineState.STARTING
        self.error: BaseException | None = None
        # Set once the engine has loaded; read-only afterwards.
        self.model_name = ""
        self.max_model_len = 0
        self.max_num_seqs = 0
        self.vocab_size = 0  # the model's (logits may be wider than the tokenizer)
        self.tokenizer_vocab_size = 0
        self.tokenizer: Tokenizer  # the tokenizer worker's: only call it through the worker
        self._engine_warm = False
        self._tokenizer_loaded = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: EngineProcess | None = None  # None before start()
        self._stopping = False  # STOP sent: the process ending is no death
        self._add_ids = itertools.count()
        self._adds: dict[int, asyncio.Future[None]] = {}  # ADD sent, ADDED not yet back
        self._resets: dict[int, asyncio.Future[int]] = {}  # RESET_PREFIX_CACHE sent, not done
        self._streams: dict[str, RequestStream] = {}  # the stream of each unfinished request
        self._metric_calls: list[tuple[Callable[[Any], None], Any]] = []

    # ----- status -----
    @property
    def is_alive(self) -> bool:
        """Liveness: the engine process is running (or has not been started yet)."""
        if self.state in (EngineState.DEAD, EngineState.STOPPED):
            return False
        return self._process is None or self._process.is_alive()

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY and self.is_alive

    @property
    def admission_bound(self) -> int:
        """Most sequences in flight at once (running + waiting); more get 503 queue_full. Every
        request is tokenized before admission counts it, so this also sizes the tokenizer's
        queue by default: a smaller one would refuse bursts that admission takes."""
        return self.config.max_num_seqs + self.max_queue

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before `start`)."""
        return None if self._process is None else self._process.pid

    # ----- lifecycle -----
    def start(self) -> None:
        """Start the engine process (it loads the weights and warms up), or adopt the one given
        as `spawned`, and load the tokenizer meanwhile. Call from the event loop."""
        loop = self._loop = asyncio.get_running_loop()
        self.state = EngineState.LOADING
        self._process = EngineProcess(
            loop, self.config, self._handle, self._on_eof,
            engine_factory=self._engine_factory, torch_threads=self.torch_threads,
            spawned=self._spawned,
        )  # fmt: skip
        self._spawned = None
        task = loop.create_task(asyncio.to_thread(self._load_tokenizer))
        task.add_done_callback(self._tokenizer_done)

    def begin_drain(self) -> None:
        """Stop admitting requests; the ones in flight go on for `shutdown_timeout` seconds, then
        are aborted with ServerShutdownError. Safe from a signal handler."""
        if self.state in (EngineState.READY, EngineState.LOADING, EngineState.WARMING_UP):
            self.state = EngineState.DRAINING
        if self._loop is not None and self._drain_deadline is None:
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                self._loop.call_soon_threadsafe(self._arm_drain_deadline)

    def _arm_drain_deadline(self) -> None:
        if self._drain_deadline is None and self._loop is not None:
            self._drain_deadline = self._loop.call_later(self.shutdown_timeout, self._drain_expired)

    def _drain_expired(self) -> None:
        if not self._streams:
            return
        ids = list(self._streams)
        logger.warning(
            "shutdown timeout (%.1f s) expired: aborting %d unfinished requests",
            self.shutdown_timeout,
            len(ids),
        )
        self._fail_all(
            ServerShutdownError(
                f"the server is shutting down: the request did not finish within the "
                f"shutdown timeout ({self.shutdown_timeout:g} s)"
            )
        )
        self._send(core.ABORT, ids)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running, stop the engine process, fail the remaining
        streams."""
        self.begin_drain()
        if self._drain_deadline is not None:
            self._drain_deadline.cancel()
        process = self._process
        if process is not None:
            self._stopping = True
            # Serving, STOP makes it abort what runs and exit. Otherwise it is killed at once:
            # still loading (commands wait until warm-up ends) there is nothing to save, and a
            # dead engine (it failed) answers nothing: one hung on a faulted device must not
            # hold up the exit that an orchestrator waits for.
            if self._engine_warm and self.state is not EngineState.DEAD:
                self._send(core.STOP)
                if not await process.join(timeout):
                    logger.warning("the engine process did not stop in %.0f s: killing it", timeout)
            await asyncio.to_thread(process.kill)
            process.close()
            process.forget()
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        self._fail_all(ServerShutdownError("the server is shutting down"))
        self.tokenizer_worker.shutdown()

    # ----- tokenizer (loaded here, in a thread, while the engine process loads weights) -----
    def _load_tokenizer(self) -> Tokenizer:
        from mlaserve.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(
            self.config.tokenizer_path, trust_remote_code=self.config.trust_remote_code
        )
        _ = tokenizer.max_piece_chars  # computed once, off the loop
        return tokenizer

    def _tokenizer_done(self, task: asyncio.Future[Tokenizer]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            logger.error("the tokenizer failed to load: %r", exc)
            if self._process is not None:
                self._process.kill()
            self._die(exc, load=True)
            return
        self.tokenizer = task.result()
        self.tokenizer_vocab_size = self.tokenizer.vocab_size
        self.tokenizer_worker.bind(self.tokenizer)
        self._tokenizer_loaded = True
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        if self._engine_warm and self._tokenizer_loaded and self.state is EngineState.WARMING_UP:
            self.state = EngineState.READY
            logger.info("ready: serving %r (max_model_len %d)", self.model_name, self.max_model_len)

    # ----- requests -----
    async def add(self, requests: list[SubRequest], arrival_time: float) -> RequestStream:
        """Hand requests to the engine; returns once the engine has validated and queued them.

        Raises the engine's validation error (a ValueError) for a bad request, QueueFullError,
        EngineNotReadyError or EngineDeadError.
        """
        assert self._loop is not None, "start() the engine first"
        self._check_accepting(len(requests))
        done: asyncio.Future[None] = self._loop.create_future()
        stream = RequestStream([r.request_id for r in requests])
        for r in requests:
            self._streams[r.request_id] = stream
        add_id = next(self._add_ids)
        self._adds[add_id] = done
        self._send(core.ADD, add_id, requests, arrival_time)
        try:
            await done
        except BaseException:
            # Rejected: nothing to abort. Cancelled (the client left): the engine may have
            # added them meanwhile, and the abort command queues behind the add.
            self.abort(stream)
            raise
        return stream

    async def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache key in the engine (between two steps); -> the pages freed.
        Requests added after this returns find nothing cached from before."""
        assert self._loop is not None, "start() the engine first"
        self._check_accepting(0)
        done: asyncio.Future[int] = self._loop.create_future()
        reset_id = next(self._add_ids)
        self._resets[reset_id] = done
        self._send(core.RESET_PREFIX_CACHE, reset_id)
        return await done

    def abort(self, stream: RequestStream) -> None:
        """Abort the stream's unfinished requests (a no-op once all finished)."""
        ids = [rid for rid in stream.request_ids if self._streams.get(rid) is stream]
        for rid in ids:
            del self._streams[rid]
        if ids:
            self._send(core.ABORT, ids)

    def _check_accepting(self, num_requests: int) -> None:
        if self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine died: {self.error!r}")
        if self.state is not EngineState.READY:
            raise EngineNotReadyError(f"the engine is {self.state.value.replace('_', ' ')}")
        capacity = self.admission_bound
        if len(self._streams) + num_requests > capacity:
            raise QueueFullError(
                f"the server is at capacity ({len(self._streams)} requests in flight, "
                f"limit {capacity}); retry later"
            )

    def _send(self, *message: Any) -> None:
        """A command to the engine process; dropped once it is dead or stopping (a dead process
        is reported by its pipe's EOF, not here)."""
        if self._process is not None and self.state is not EngineState.DEAD:
            self._process.send(*message)

    # ----- messages from the engine process (on the event loop) -----
    def _handle(self, message: tuple) -> None:
        tag = message[0]
        if tag == core.STEP:
            _, wire, stats = message
            outputs = decode_outputs(wire)
            self._dispatch(outputs)
            self._metric(self.metrics.on_outputs, outputs)
            if stats is not None:
                self._metric(self.metrics.on_stats, stats)
        elif tag == core.ADDED:
            _, add_id, error, added = message
            done = self._adds.pop(add_id, None)
            if error is None:
                self._metric(self.metrics.on_added, added)
            if done is not None and not done.done():
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)
        elif tag == core.RESET_DONE:
            _, reset_id, freed = message
            pending = self._resets.pop(reset_id, None)
            if pending is not None and not pending.done():
                pending.set_result(freed)
        elif tag == core.ABORTED:
            self._metric(self.metrics.on_aborted, message[1])
        elif tag == core.STATS:
            self._metric(self.metrics.on_stats, message[1])
        elif tag == core.LOADED:
            self._on_loaded(message[1])
        elif tag == core.READY:
            self.metrics.on_stats(message[1])
            self._engine_warm = True
            self._maybe_ready()
        elif tag == core.FAILED:
            _, phase, error = message
            self._die(RuntimeError(error) if isinstance(error, str) else error, phase == "load")
        # STOPPED needs nothing: shutdown() waits for the process itself.

    def _metric(self, record: Callable[[Any], None], arg: Any) -> None:
        """Record metrics after the woken streams ran (their tasks were scheduled first), so a
        token's SSE frame leaves before its bookkeeping; one FIFO keeps the records in order."""
        if not self._metric_calls:
            assert self._loop is not None
            self._loop.call_soon(self._record_metrics)
        self._metric_calls.append((record, arg))

    def _record_metrics(self) -> None:
        calls, self._metric_calls = self._metric_calls, []
        for record, arg in calls:
            record(arg)

    def _on_loaded(self, info: core.EngineInfo) -> None:
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.max_num_seqs = info.max_num_seqs
        self.vocab_size = info.vocab_size
        self.metrics.bind_model(self.model_name)
        if self.state is EngineState.LOADING:
            self.state = EngineState.WARMING_UP

    def _on_eof(self) -> None:
        """The engine process closed its end: it exited (or is about to)."""
        process = self._process
        if process is None:
            return
        process.close()
        if self._stopping or self.state is EngineState.DEAD:
            return
        self._die(
            RuntimeError(f"the engine process {process.exit_description()}"),
            load=self.state in (EngineState.LOADING, EngineState.WARMING_UP),
        )

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del streams[out.request_id]
            stream.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        streams = {id(s): s for s in self._streams.values()}
        self._streams.clear()
        for stream in streams.values():
            stream.put(exc)
        resets, self._resets = self._resets, {}
        for pending in resets.values():
            if not pending.done():
                pending.set_exception(exc)

    def _die(self, exc: BaseException, load: bool) -> None:
        """The engine is gone: fail what waits on it, once; tell the server (it exits 1)."""
        if self.state is EngineState.DEAD:
            return
        self.state = EngineState.DEAD
        self.error = exc
        logger.error("the engine %s: %r", "failed to start" if load else "died", exc)
        dead = EngineDeadError(f"the engine died: {exc!r}")
        adds, self._adds = self._adds, {}
        for done in adds.values():
            if not done.done():
                done.set_exception(dead)
        self._fail_all(dead)
        callback = self._on_load_error if load else self._on_fatal
        if callback is not None:
            callback(exc)
