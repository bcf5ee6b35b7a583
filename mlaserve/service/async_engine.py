"""The engine thread and its asyncio bridge.

`LLMEngine` is not thread-safe and `step()` blocks for a whole forward pass, so the engine lives
on one dedicated thread that also loads the weights and runs the warm-up. The event loop talks
to it only through a command queue (add / abort / stop). The thread drains the commands between
steps, calls `step()` while there is work, blocks on the queue when idle (no busy-spin), and
hands each step's outputs back with one `loop.call_soon_threadsafe`, where they are routed to
the `RequestStream` of the HTTP request that owns them.

If the thread dies, every in-flight stream raises `EngineDeadError`, /health turns 503 and
`on_fatal` is called (the CLI then exits non-zero so that an orchestrator restarts the server).

Shutdown: `begin_drain` (SIGTERM) stops admitting and arms a `shutdown_timeout` deadline; what is
still running then is aborted and its streams raise `ServerShutdownError`, so that every open
response ends on its own terms (an SSE error event and `[DONE]`, or a 503 body) before uvicorn's
own, later, graceful-shutdown timeout would cut the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlaserve.service.metrics import Metrics
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
    STARTING = "starting"  # thread not started yet
    LOADING = "loading"  # loading weights
    WARMING_UP = "warming_up"  # warm-up: dummy steps, kernel compilation, graph capture
    READY = "ready"
    DRAINING = "draining"  # shutting down: no new requests, in-flight ones go on
    STOPPED = "stopped"
    DEAD = "dead"  # the engine thread raised


class EngineDeadError(RuntimeError):
    """The engine thread is gone; nothing more will come out of it."""

    code = "engine_dead"


class EngineNotReadyError(RuntimeError):
    """The engine is loading, warming up, draining or stopped."""


class ServerShutdownError(RuntimeError):
    """The request was still running when the shutdown timeout expired; it was aborted."""

    code = "server_shutdown"


class QueueFullError(RuntimeError):
    """Admitting the request would exceed max_num_seqs + max_queue in-flight requests."""


@dataclass(slots=True)
class _Add:
    requests: list[SubRequest]
    arrival_time: float
    done: asyncio.Future[None]


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


_STOP = object()


class AsyncEngine:
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
        tokenizer_queue: int = 64,
        torch_threads: int | None = None,
    ) -> None:
        self.config = config
        self.max_queue = max_queue
        self.shutdown_timeout = shutdown_timeout
        self.tokenizer_worker = TokenizerWorker(tokenizer_queue)
        self._on_fatal = on_fatal
        self.torch_threads = torch_threads  # set on the engine thread (OpenMP: per thread)
        self._drain_deadline: asyncio.TimerHandle | None = None
        self.metrics = metrics if metrics is not None else Metrics()
        self._engine_factory = engine_factory
        self._on_load_error = on_load_error
        self.state = EngineState.STARTING
        self.error: BaseException | None = None
        # Set once the engine has loaded; read-only afterwards.
        self.model_name = ""
        self.max_model_len = 0
        self.max_num_seqs = 0
        self.vocab_size = 0  # the model's (logits may be wider than the tokenizer)
        self.tokenizer_vocab_size = 0
        self.tokenizer: Tokenizer  # the tokenizer worker's copy: only call it through the worker
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "accepting?" + put against "dead" + drain
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Event-loop side: the stream of each unfinished engine request.
        self._streams: dict[str, RequestStream] = {}
        # Engine-thread side: requests the engine holds (added, not finished nor aborted).
        self._live: set[str] = set()

    # ----- status -----
    @property
    def is_alive(self) -> bool:
        """Liveness: the engine thread is running (or has not been started yet)."""
        if self.state in (EngineState.DEAD, EngineState.STOPPED):
            return False
        return self._thread is None or self._thread.is_alive()

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY and self.is_alive

    # ----- lifecycle (event loop) -----
    def start(self) -> None:
        """Start the engine thread; it loads the weights and warms up. Call from the loop."""
        self._loop = asyncio.get_running_loop()
        self.state = EngineState.LOADING
        self._thread = threading.Thread(target=self._run, name="mlaserve-engine", daemon=True)
        self._thread.start()

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
        if self.state is not EngineState.DEAD:
            self._commands.put(_Abort(ids))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running, stop the thread and fail the remaining streams."""
        self.begin_drain()
        if self._drain_deadline is not None:
            self._drain_deadline.cancel()
        self._commands.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        self._fail_all(ServerShutdownError("the server is shutting down"))
        self.tokenizer_worker.shutdown()

    # ----- requests (event loop) -----
    async def add(self, requests: list[SubRequest], arrival_time: float) -> RequestStream:
        """Hand requests to the engine; returns once the engine has validated and queued them.

        Raises the engine's validation error (a ValueError) for a bad request, QueueFullError,
        EngineNotReadyError or EngineDeadError.
        """
        assert self._loop is not None, "start() the engine first"
        done: asyncio.Future[None] = self._loop.create_future()
        stream = RequestStream([r.request_id for r in requests])
        with self._lock:
            self._check_accepting(len(requests))
            for r in requests:
                self._streams[r.request_id] = stream
            self._commands.put(_Add(requests, arrival_time, done))
        try:
            await done
        except BaseException:
            # Rejected: nothing to abort. Cancelled (the client left): the engine may have
            # added them meanwhile, and the abort command queues behind the add.
            self.abort(stream)
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Abort the stream's unfinished requests (a no-op once all finished)."""
        ids = [rid for rid in stream.request_ids if self._streams.get(rid) is stream]
        for rid in ids:
            del self._streams[rid]
        if ids and self.state is not EngineState.DEAD:
            self._commands.put(_Abort(ids))

    def _check_accepting(self, num_requests: int) -> None:
        if self.state is EngineState.DEAD:
            raise EngineDeadError(f"the engine died: {self.error!r}")
        if self.state is not EngineState.READY:
            raise EngineNotReadyError(f"the engine is {self.state.value.replace('_', ' ')}")
        capacity = self.max_num_seqs + self.max_queue
        if len(self._streams) + num_requests > capacity:
            raise QueueFullError(
                f"the server is at capacity ({len(self._streams)} requests in flight, "
                f"limit {capacity}); retry later"
            )

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        streams = {id(s): s for s in self._streams.values()}
        self._streams.clear()
        for stream in streams.values():
            stream.put(exc)

    @staticmethod
    def _resolve(done: asyncio.Future[None], exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    # ----- engine thread -----
    def _run(self) -> None:
        try:
            engine = self._load()
        except BaseException as e:
            logger.exception("the engine failed to start")
            self._die(e)
            if self._on_load_error is not None:
                self._on_load_error(e)
            return
        try:
            self._serve(engine)
        except BaseException as e:
            logger.exception("the engine thread died; failing every open request")
            self._die(e)
            if self._on_fatal is not None:
                self._on_fatal(e)

    def _load(self) -> LLMEngine:
        if self._engine_factory is None:
            from mlaserve.llm_engine import LLMEngine

            self._engine_factory = LLMEngine
        if self.torch_threads is not None:
            import torch

            torch.set_num_threads(self.torch_threads)
        t0 = time.perf_counter()
        logger.info("loading weights from %s", self.config.model_path)
        engine = self._engine_factory(self.config)
        t1 = time.perf_counter()
        logger.info("weights loaded in %.1f s", t1 - t0)
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.config.max_num_seqs
        self.vocab_size = engine.model_config.vocab_size
        self.tokenizer_vocab_size = engine.tokenizer.vocab_size
        _ = engine.tokenizer.max_piece_chars  # computed here, once, and copied along
        self.tokenizer = _private_copy(engine.tokenizer)
        self.tokenizer_worker.bind(self.tokenizer)
        self.metrics.bind_model(self.model_name)
        if self.state is EngineState.LOADING:
            self.state = EngineState.WARMING_UP
        logger.info("warming up (kernel compilation, graph capture)")
        engine.warmup()
        logger.info("warm-up done in %.1f s", time.perf_counter() - t1)
        with self._lock:
            if self.state is EngineState.WARMING_UP:
                self.state = EngineState.READY
        self.metrics.on_stats(engine.get_stats())
        logger.info("ready: serving %r (max_model_len %d)", self.model_name, self.max_model_len)
        return engine

    def _serve(self, engine: LLMEngine) -> None:
        while True:
            commands = self._next_commands(block=not engine.has_unfinished_requests())
            for i, command in enumerate(commands):
                if command is _STOP:
                    self._abort_everything(engine, commands[i + 1 :])
                    return
                self._apply(engine, command)
            if engine.has_unfinished_requests():
                outputs = engine.step()
                self.metrics.on_outputs(outputs)
                self._live.difference_update(o.request_id for o in outputs if o.finished)
                if outputs:
                    self._call_soon(self._dispatch, outputs)
            self.metrics.on_stats(engine.get_stats())

    def _next_commands(self, block: bool) -> list[Any]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, engine: LLMEngine, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._abort(engine, command.request_ids)
            return
        added: list[str] = []
        try:
            for r in command.requests:
                engine.add_request(r.request_id, r.prompt_token_ids, r.params, command.arrival_time)
                added.append(r.request_id)
        except Exception as e:  # a bad request must not kill the engine
            for rid in added:
                engine.abort_request(rid)
            self._call_soon(self._resolve, command.done, e)
            return
        self._live.update(added)
        self.metrics.on_added(added)
        self._call_soon(self._resolve, command.done, None)

    def _abort(self, engine: LLMEngine, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._live]
        for rid in live:
            engine.abort_request(rid)  # frees its KV pages now
        self._live.difference_update(live)
        self.metrics.on_aborted(live)

    def _abort_everything(self, engine: LLMEngine, pending: list[Any]) -> None:
        for command in pending + self._next_commands(block=False):
            if isinstance(command, _Add):
                self._call_soon(self._resolve, command.done, EngineNotReadyError("shutting down"))
        self._abort(engine, list(self._live))
        self.metrics.on_stats(engine.get_stats())

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self.state = EngineState.DEAD
            self.error = exc
            pending = self._next_commands(block=False)
        dead = EngineDeadError(f"the engine died: {exc!r}")
        for command in pending:
            if isinstance(command, _Add):
                self._call_soon(self._resolve, command.done, dead)
        self._call_soon(self._fail_all, dead)

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            self._loop.call_soon_threadsafe(fn, *args)


def _private_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A copy for the tokenizer worker: HF fast tokenizers raise "Already borrowed" when two threads
    use one instance and one of them changes its truncation or padding settings."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:
        logger.warning("could not copy the tokenizer; sharing the engine's instance")
        return tokenizer
