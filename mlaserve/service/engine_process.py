"""`EngineProcess`: the engine's OS process as the server sees it: spawned, its command pipe, its
messages read on the event loop (`EngineInbox`), killed.

Owned by `AsyncEngine`, which decides when each of these happens; this class holds no engine
state. The pipes' child ends are closed here right after the spawn, so the child's exit reads
as EOF on this side (`on_eof`), however it exits. An exit hook kills the process if the server
exits without `kill()`; the engine process also exits by itself when this process vanishes
(engine_core's parent watch).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from mlaserve.service import engine_core as core
from mlaserve.service.engine_inbox import EngineInbox

if TYPE_CHECKING:
    from mlaserve.config import EngineConfig
    from mlaserve.llm_engine import LLMEngine

__all__ = ["EngineProcess"]

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
    ) -> None:
        """Spawn it; from here on each of its messages goes to `on_message` on `loop`, and its
        exit (its output pipe's EOF, after the messages sent before it) to `on_eof`."""
        ctx = multiprocessing.get_context("spawn")
        commands_rx, commands = ctx.Pipe(duplex=False)
        outputs, outputs_tx = ctx.Pipe(duplex=False)
        self.proc: BaseProcess = ctx.Process(
            target=core.run_engine_core,
            args=(
                config,
                commands_rx,
                outputs_tx,
                engine_factory,
                torch_threads,
                logging.getLogger("mlaserve").getEffectiveLevel(),
            ),
            name="mlaserve-engine",
        )
        self.proc.start()
        commands_rx.close()  # the child's ends: its exit must read as EOF here
        outputs_tx.close()
        atexit.register(self.kill)
        self.commands: Connection | None = commands  # None once closed
        self._inbox: EngineInbox | None = EngineInbox(loop, outputs, on_message, on_eof)
        logger.info("engine process started (pid %d)", self.proc.pid)

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
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(_KILL_WAIT_S)

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
        atexit.unregister(self.kill)

    def exit_description(self) -> str:
        """How it ended, for the death's message: "was killed by SIGKILL", "exited with code 1"
        (waits up to 1 s for the exit status after its pipe's EOF)."""
        self.proc.join(1.0)
        code = self.proc.exitcode
        if code is not None and code < 0 and -code in signal.Signals._value2member_map_:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"
