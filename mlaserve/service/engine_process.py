"""`EngineProcess`: the engine's OS process as the server sees it: spawned, its command pipe, its
messages read on the event loop (`EngineInbox`), killed.

Owned by `AsyncEngine`, which decides when each of these happens; this class holds no engine
state. `spawn_engine` starts the process without an event loop: `mlaserve serve` spawns it first
thing, and `AsyncEngine.start` adopts it once the loop runs. The pipes' child ends are closed here right after the spawn, so the child's exit reads
as EOF on this side (`on_eof`), however it exits. An exit hook kills the process if the server
exits without `kill()`; the engine process also exits by itself when this process vanishes
(engine_core's parent watch).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from mlaserve.kernel_compile_pool import main_hidden
from mlaserve.service import engine_core as core
from mlaserve.service.engine_inbox import EngineInbox
from mlaserve.startup_times import process_age_s

if TYPE_CHECKING:
    from mlaserve.config import EngineConfig
    from mlaserve.llm_engine import LLMEngine

__all__ = ["EngineProcess", "SpawnedEngine", "spawn_engine"]

logger = logging.getLogger("mlaserve.service")

_KILL_WAIT_S = 5.0


class EngineProcess:
    """One spawned engine process (`engine_core.run_engine_core`) and this side's pipe ends."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        config: EngineConfig,
        on_message: Callable[[tuple], None],
        on_eof: Callable[[], None],
        *,
        engine_factory: Callable[[EngineConfig], LLMEngine] | None = None,
        torch_threads: int | None = None,
        spawned: SpawnedEngine | None = None,
    ) -> None:
        """Spawn it (or adopt `spawned`, started earlier by `spawn_engine`); from here on each of
        its messages goes to `on_message` on `loop`, and its exit (its output pipe's EOF, after
        the messages sent before it) to `on_eof`."""
        if spawned is None:
            spawned = spawn_engine(
                config, engine_factory=engine_factory, torch_threads=torch_threads
            )
        self.proc: BaseProcess = spawned.proc
        self._exit_hook = spawned.exit_hook
        self.commands: Connection | None = spawned.commands  # None once closed
        self._inbox: EngineInbox | None = EngineInbox(loop, spawned.outputs, on_message, on_eof)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def send(self, *message: Any) -> None:
        """A command to the process; dropped once the pipe is closed (a dead process is
        reported by its output pipe's EOF, not here)."""
        if self.commands is None:
            return
        with contextlib.suppress(OSError):  # a broken pipe: its EOF is on its way
            self.commands.send_bytes(core.dumps(message))

    async def join(self, timeout: float) -> bool:
        """Wait up to `timeout` s for it to exit (off the loop); -> whether it has."""
        await asyncio.to_thread(self.proc.join, timeout)
        return not self.proc.is_alive()

    def kill(self) -> None:
        """SIGKILL it if it runs, and reap it (blocks up to 5 s)."""
        _kill(self.proc)

    def close(self) -> None:
        """Close this side's pipe ends (idempotent)."""
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
        if self.commands is not None:
            self.commands.close()
            self.commands = None

    def forget(self) -> None:
        """The process is gone or killed: no exit hook for it any more."""
        atexit.unregister(self._exit_hook)

    def exit_description(self) -> str:
        """How it ended, for the death's message: "was killed by SIGKILL", "exited with code 1"
        (waits up to 1 s for the exit status after its pipe's EOF)."""
        self.proc.join(1.0)
        code = self.proc.exitcode
        if code is not None and code < 0 and -code in signal.Signals._value2member_map_:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


@dataclass(frozen=True)
class SpawnedEngine:
    """An engine process just spawned, and this side's ends of its pipes."""

    proc: BaseProcess
    commands: Connection
    outputs: Connection
    server_age_s: float | None  # the server process's age when it spawned this one
    exit_hook: Callable[[], None]  # registered with atexit: kills the process


def spawn_engine(
    config: EngineConfig,
    *,
    engine_factory: Callable[[EngineConfig], LLMEngine] | None = None,
    torch_threads: int | None = None,
) -> SpawnedEngine:
    """Start the engine process now (no event loop needed: `mlaserve serve` calls this before it
    imports the HTTP stack, so the engine's imports and the server's overlap). Its start-up
    phases get `server_start`: this process's age at the spawn."""
    ctx = multiprocessing.get_context("spawn")
    commands_rx, commands = ctx.Pipe(duplex=False)
    outputs, outputs_tx = ctx.Pipe(duplex=False)
    age = process_age_s()
    proc = ctx.Process(
        target=core.run_engine_core,
        args=(
            config,
            commands_rx,
            outputs_tx,
            engine_factory,
            torch_threads,
            logging.getLogger("mlaserve").getEffectiveLevel(),
            age,
        ),
        name="mlaserve-engine",
    )
    with _main_not_reimported():
        proc.start()
    commands_rx.close()  # the child's ends: its exit must read as EOF here
    outputs_tx.close()
    hook = functools.partial(_kill, proc)
    atexit.register(hook)
    when = "" if age is None else f", {age:.2f} s after the server process started"
    logger.info("engine process started (pid %d)%s", proc.pid, when)
    return SpawnedEngine(proc, commands, outputs, age, hook)


def _kill(proc: BaseProcess) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join(_KILL_WAIT_S)


def _is_mlaserve_cli(main: Any) -> bool:
    """Whether `__main__` is mlaserve's own entry point: `python -m mlaserve` (its spec names
    the package) or the `mlaserve` console script (a file named so). A script that imports
    `main` from the CLI and patches something first is a user's script: its module re-runs in
    the child, so that its patches hold there too."""
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name in ("mlaserve.__main__", "mlaserve.service.cli")
    return os.path.basename(getattr(main, "__file__", None) or "") == "mlaserve"


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """`spawn` re-imports the parent's `__main__` in the child. When that is mlaserve's CLI
    (`python -m mlaserve` or the `mlaserve` script) it is only the option parser and its pydantic
    models, which the engine never uses: hide it while the child's start data is taken. Any
    other `__main__` (a user's script, whose functions the child may need) is left as it is."""
    main = sys.modules.get("__main__")
    if main is None or not _is_mlaserve_cli(main):
        yield
        return
    with main_hidden():
        yield
