"""The engine process: owns the model and the device, runs the step loop, streams outputs back.

The HTTP server (`AsyncEngine`, the frontend) starts this with multiprocessing's `spawn` (CUDA
cannot be used in a forked child), as vLLM V1's EngineCore and SGLang's scheduler process are
started. The two processes share no GIL: while the engine computes step n+1, the frontend turns
step n's outputs into SSE chunks, so the HTTP per-token work overlaps the steps instead of adding
to them.

Wire protocol: two one-way `multiprocessing` pipes carrying pickled tuples (protocol 5; a bs-1
step is one small message, cheap to pickle and unpickle: `output_wire.py`).

    frontend -> engine   (ADD, add_id, [SubRequest], arrival_time) | (ABORT, [request_id]) | (STOP,)
                         | (RESET_PREFIX_CACHE, reset_id)
    engine -> frontend   (LOADED, EngineInfo)                 weights loaded, warming up
                         (READY, EngineStats)                 warm-up and graph capture done
                         (ADDED, add_id, error | None, [request_id])
                         (STEP, [RequestOutput as a tuple], EngineStats | None)
                         (ABORTED, [request_id])              the ones the engine still held
                         (STATS, EngineStats)
                         (RESET_DONE, reset_id, pages freed)  the prefix cache was reset
                         (FAILED, "load" | "serve", exception)  its traceback is logged here
                         (STOPPED,)

Outputs are DELTA outputs; `prompt_token_ids` is sent with a request's first output only (the
frontend counts prompt tokens then), so a step costs O(new tokens), not O(prompt). Stats are sent
only when they changed, at most every `STATS_INTERVAL_S` while busy and always when the engine
goes idle, so /metrics is exact at rest.

Commands arrive on a reader thread (so the frontend's writes never wait for a long step), which
queues them for the loop; the loop drains them between steps and blocks on the queue when idle.
The reader thread also compiles a structured request's grammar before queueing its ADD (tens of
ms per schema, seconds for the first on a 129k vocabulary), so that never stalls the steps of
every other stream: the ADD reaches the loop with its matchers (or its refusal) attached.

Life and death: the child ignores SIGINT and SIGTERM (a Ctrl-C or a signal sent to the process
group must not kill it under a draining server); the frontend stops it with STOP, or kills it.
If the frontend dies, the command pipe reaches EOF: the loop stops after the current step, and a
watchdog exits the process if that step never ends (no orphan holding the GPU). Any exception
out of loading or the step loop (a CUDA error such as a device-side assert surfaces as one at
the next synchronisation), or out of the command thread, is logged, sent as FAILED and ends the
process with `os._exit(1)` at once: no cleanup that could hang on a faulted device.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from mlaserve.jit_cache import cache_python_bytecode
from mlaserve.kernel_compile_pool import compile_processes_wanted, start_compile_server
from mlaserve.service.engine_errors import EngineNotReadyError
from mlaserve.service.output_wire import encode_outputs

if TYPE_CHECKING:
    from mlaserve.config import EngineConfig
    from mlaserve.llm_engine import EngineStats, LLMEngine

__all__ = ["EngineInfo", "run_engine_core"]

logger = logging.getLogger("mlaserve.service")

# Message tags (small ints: the cheapest thing to pickle and compare).
ADD, ABORT, STOP, RESET_PREFIX_CACHE = 0, 1, 2, 3
LOADED, READY, ADDED, STEP, ABORTED, STATS, FAILED, STOPPED, RESET_DONE = range(10, 19)

STATS_INTERVAL_S = 0.05
# After the frontend vanished: how long the current step may still take before the process exits.
ORPHAN_GRACE_S = 10.0
# An idle engine wakes this often to check its tensor-parallel group (`LLMEngine.check_health`),
# so a rank or node lost between requests fails the engine, and /health, within about this.
IDLE_CHECK_S = 1.0
_NO_PROMPT: list[int] = []  # sent instead of the prompt after a request's first output
_PARENT_GONE = (STOP, "parent_gone")
_READER_FAILED = -1  # (_READER_FAILED, exception): the command thread died; the loop raises it


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the frontend needs to know about the loaded model."""

    model_name: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int  # the model's (logits may be wider than the tokenizer)


def dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=5)


def run_engine_core(
    config: EngineConfig,
    commands: Connection,
    outputs: Connection,
    engine_factory: Callable[[EngineConfig], LLMEngine] | None,
    torch_threads: int | None,
    log_level: int,
    server_age_s: float | None = None,
) -> None:
    """The engine process's entry point (`multiprocessing.Process(target=...)`). `server_age_s`:
    the server process's age when it spawned this one (the `server_start` phase)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s"
    )
    EngineCore(config, commands, outputs, engine_factory, torch_threads, server_age_s).run()


def _freeze_heap() -> int:
    """Move every object alive now (the model's modules, the graphs, the buffers: ~245k tracked
    objects for the default model) to the garbage collector's permanent generation -> how many.
    They live as long as this process, which owns the engine alone and never drops it while
    serving; later collections then skip them. A full collection of that heap is a long pause of
    every stream whenever the collector runs one (bench/RESULTS.md, thirteenth session; the heap
    grows with the layers of a larger model); vLLM freezes its workers' heaps after warm-up for the
    same reason (vllm-project/vllm#44363). Collected first, so no garbage is frozen with it."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        commands: Connection,
        outputs: Connection,
        engine_factory: Callable[[EngineConfig], LLMEngine] | None,
        torch_threads: int | None,
        server_age_s: float | None = None,
    ) -> None:
        self.config = config
        self._server_age_s = server_age_s
        self._commands_conn = commands
        self._out = outputs
        self._engine_factory = engine_factory
        self._torch_threads = torch_threads
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        # Requests the engine holds (added, not finished nor aborted) -> first output sent yet?
        self._live: dict[str, bool] = {}
        self._last_stats: EngineStats | None = None
        self._last_stats_time = 0.0
        self._engine: LLMEngine | None = None  # set once loaded (the command thread reads it)

    def _send(self, *message: Any) -> None:
        self._out.send_bytes(dumps(message))

    # ----- process -----
    def run(self) -> None:
        threading.Thread(target=self._read_commands, name="mlaserve-commands", daemon=True).start()
        try:
            engine = self._load()
        except BaseException as e:
            logger.exception("the engine failed to start")
            self._send_failure("load", e)
            return
        try:
            self._serve(engine)
        except BaseException as e:
            logger.exception("the engine died; failing every open request")
            self._send_failure("serve", e)
        finally:
            # Tensor-parallel workers stop here, with rank 0 still in the group: at this
            # process's exit multiprocessing terminates daemonic children before atexit runs.
            engine.shutdown()

    def _send_failure(self, phase: str, exc: BaseException) -> None:
        with contextlib.suppress(OSError):  # the frontend is gone too
            self._send(FAILED, phase, _picklable(exc, RuntimeError))
        os._exit(1)  # a device in an unknown state: no cleanup that could hang on it

    def _read_commands(self) -> None:
        """Reader thread: commands into the queue; EOF (the frontend died) stops the loop."""
        try:
            while True:
                command = pickle.loads(self._commands_conn.recv_bytes())
                if command[0] == ADD:
                    command = self._compile_grammars(command)
                self._commands.put(command)
        except (EOFError, OSError):
            pass
        except BaseException as e:
            # A command that cannot be read (a bug): without this thread the loop would wait
            # for commands forever while the server waits for their answers. The loop raises
            # it instead, which sends FAILED and exits 1.
            self._commands.put((_READER_FAILED, e))
            return
        self._commands.put(_PARENT_GONE)
        time.sleep(ORPHAN_GRACE_S)
        logger.error("the server process is gone and the engine did not stop: exiting")
        os._exit(1)

    def _compile_grammars(self, command: tuple) -> tuple:
        """On the command thread, before the loop sees an ADD: its structured requests' grammars
        compiled (xgrammar releases the GIL while compiling, so the engine keeps stepping).
        -> (ADD, add_id, requests, arrival_time, {request_id: matcher} or the refusal). Commands
        stay in order: a later ABORT cannot overtake its ADD. Before the engine is loaded the
        loop compiles (the server accepts no request then anyway)."""
        engine = self._engine
        _, add_id, requests, arrival_time = command
        if engine is None or all(r.params.structured_outputs is None for r in requests):
            return command
        grammars: dict[str, Any] = {}
        try:
            for r in requests:
                if r.params.structured_outputs is not None:
                    grammars[r.request_id] = engine.compile_grammar(r.params)
        except Exception as e:  # refused when the loop applies the ADD
            return (ADD, add_id, requests, arrival_time, e)
        return (ADD, add_id, requests, arrival_time, grammars)

    def _load(self) -> LLMEngine:
        # Before torch's import: its bytecode read from (and written to) the cache folder.
        cache_python_bytecode(self.config.cache_dir)
        # A start that will compile (an empty cache): the compile workers' fork server imports
        # torch beside this process's own import (`kernel_compile_pool.py`).
        if compile_processes_wanted(self.config.device, self.config.tensor_parallel_size):
            start_compile_server()
        # torch's import timed on its own: the engine's start-up phase `torch_import`.
        t_import = time.perf_counter()
        fresh = "torch" not in sys.modules
        import torch

        torch_import_s = time.perf_counter() - t_import
        factory = self._engine_factory
        if factory is None:
            from mlaserve.llm_engine import LLMEngine as factory

        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)  # OpenMP: per process, set here
        logger.info("engine process: %d torch intra-op threads", torch.get_num_threads())
        t0 = time.perf_counter()
        logger.info("loading weights from %s", self.config.model_path)
        engine = factory(self.config)
        t1 = time.perf_counter()
        startup = getattr(engine, "startup", None)  # a test's scripted engine may have none
        if fresh and startup is not None:
            startup.add("torch_import", torch_import_s)
        if startup is not None and self._server_age_s is not None:
            startup.add("server_start", self._server_age_s)
        logger.info("weights loaded in %.1f s", t1 - t0)
        info = EngineInfo(
            model_name=engine.model_name,
            max_model_len=engine.max_model_len,
            max_num_seqs=engine.config.max_num_seqs,
            vocab_size=engine.model_config.vocab_size,
        )
        self._send(LOADED, info)
        logger.info("warming up (kernel compilation, graph capture)")
        engine.warmup()
        logger.info("warm-up done in %.1f s", time.perf_counter() - t1)
        logger.info("froze the engine process's heap: %d objects", _freeze_heap())
        stats = engine.get_stats()
        self._last_stats, self._last_stats_time = stats, time.monotonic()
        self._engine = engine
        self._send(READY, stats)
        return engine

    # ----- the loop -----
    def _serve(self, engine: LLMEngine) -> None:
        while True:
            commands = self._next_commands(not engine.has_unfinished_requests(), engine)
            for i, command in enumerate(commands):
                if command[0] == STOP:
                    self._stop(engine, commands[i + 1 :], parent_gone=command is _PARENT_GONE)
                    return
                self._apply(engine, command)
            busy = engine.has_unfinished_requests()
            if busy:
                outputs = engine.step()
                live = self._live
                for out in outputs:
                    rid = out.request_id
                    if live.get(rid):
                        out.prompt_token_ids = _NO_PROMPT
                    else:
                        live[rid] = True
                    if out.finished:
                        live.pop(rid, None)
                busy = engine.has_unfinished_requests()
                stats = self._due_stats(engine, idle=not busy)
                if outputs or stats is not None:
                    self._send(STEP, encode_outputs(outputs), stats)
            else:
                stats = self._due_stats(engine, idle=True)
                if stats is not None:
                    self._send(STATS, stats)

    def _due_stats(self, engine: LLMEngine, idle: bool) -> EngineStats | None:
        """The engine's stats if they are due and changed since the last sent, else None."""
        now = time.monotonic()
        if not idle and now - self._last_stats_time < STATS_INTERVAL_S:
            return None
        stats = engine.get_stats()
        self._last_stats_time = now
        if stats == self._last_stats:
            return None
        self._last_stats = stats
        return stats

    def _next_commands(self, block: bool, engine: LLMEngine | None = None) -> list[tuple]:
        """The queued commands; with `block`, waits for one, checking `engine`'s health every
        `IDLE_CHECK_S` meanwhile (its death raises out of the loop)."""
        if not block and self._commands.empty():
            return []  # the usual case between two steps: no exception raised and caught
        commands = []
        while block and not commands:
            try:
                commands.append(self._commands.get(timeout=IDLE_CHECK_S))
            except queue.Empty:
                if engine is not None:
                    engine.check_health()
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, engine: LLMEngine, command: tuple) -> None:
        if command[0] == ABORT:
            self._abort(engine, command[1])
            return
        if command[0] == RESET_PREFIX_CACHE:
            # Between steps: every key goes, and a later ADD (queued behind) finds none.
            self._send(RESET_DONE, command[1], engine.reset_prefix_cache())
            return
        if command[0] == _READER_FAILED:
            cause = command[1]
            raise RuntimeError(f"the engine's command thread failed: {cause!r}") from cause
        _, add_id, requests, arrival_time, *prepared = command
        grammars = prepared[0] if prepared else {}
        if isinstance(grammars, Exception):  # a schema the command thread's compile refused
            self._send(ADDED, add_id, _picklable(grammars, ValueError), [])
            return
        added: list[str] = []
        try:
            for r in requests:
                grammar = grammars.get(r.request_id)
                engine.add_request(
                    r.request_id, r.prompt_token_ids, r.params, arrival_time, grammar=grammar,
                    cache_salt=r.cache_salt,
                )  # fmt: skip
                added.append(r.request_id)
        except Exception as e:  # a bad request must not kill the engine
            for rid in added:
                engine.abort_request(rid)
            self._send(ADDED, add_id, _picklable(e, ValueError), [])
            return
        for rid in added:
            self._live[rid] = False
        self._send(ADDED, add_id, None, added)

    def _abort(self, engine: LLMEngine, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._live]
        for rid in live:
            engine.abort_request(rid)  # frees its KV pages now
            del self._live[rid]
        if live:
            self._send(ABORTED, live)

    def _stop(self, engine: LLMEngine, pending: list[tuple], parent_gone: bool) -> None:
        if parent_gone:
            logger.warning("the server process is gone: stopping the engine")
            return
        for command in pending + self._next_commands(block=False):
            if command[0] == ADD:
                self._send(ADDED, command[1], EngineNotReadyError("shutting down"), [])
        self._abort(engine, list(self._live))
        self._send(STATS, engine.get_stats())
        self._send(STOPPED)


def _picklable(exc: BaseException, fallback: type[Exception]) -> BaseException:
    """The exception itself when it survives pickling (validation errors carry `param`), else
    `fallback` with its message (an engine failure: its repr)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return fallback(str(exc) if fallback is ValueError else repr(exc))
    return exc
