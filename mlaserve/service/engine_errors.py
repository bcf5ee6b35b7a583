"""Why the engine did not take or finish a request (raised by `AsyncEngine`, mapped to HTTP
errors by `Serving`). Shared by the frontend and the engine process, which pickles some of them."""

from __future__ import annotations

__all__ = ["EngineDeadError", "EngineNotReadyError", "QueueFullError", "ServerShutdownError"]


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing more will come out of it."""

    code = "engine_dead"


class EngineNotReadyError(RuntimeError):
    """The engine is loading, warming up, draining or stopped."""


class ServerShutdownError(RuntimeError):
    """The request was still running when the shutdown timeout expired; it was aborted."""

    code = "server_shutdown"


class QueueFullError(RuntimeError):
    """Admitting the request would exceed max_num_seqs + max_queue in-flight requests."""
