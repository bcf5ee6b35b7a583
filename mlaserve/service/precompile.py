"""`mlaserve precompile [MODEL] [engine options]`: fill the JIT cache for one configuration,
without serving.

It builds the engine exactly as `mlaserve serve` would with the same engine options (the same
`EngineConfig`, the same `--cache-dir`), runs the warm-up (the throwaway request, every graph
shape, every capture: each JIT compilation a server start would run), prints where the cache is,
how many compilations the warm-up ran and the start-up phases, and exits 0. A later
`mlaserve serve` with the same options and cache folder then compiles nothing (its compile watch
logs 0): run it in an image build on a GPU machine, or as an init container writing the volume
the server mounts (README, "Deployment").

Exit codes as `serve`'s: 2 for a bad option or model folder (one line, before anything loads),
1 if the engine fails to build or warm up.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from mlaserve.service.settings import Settings

__all__ = ["precompile"]

logger = logging.getLogger("mlaserve.service")


def precompile(
    settings: Settings, torch_threads: int | None = None, out: TextIO | None = None
) -> int:
    """Build, warm up and shut down the engine of `settings.engine`; report to `out` (stdout).
    `torch_threads`: torch's intra-op threads (None: torch's choice)."""
    out = sys.stdout if out is None else out
    server = settings.server
    logging.basicConfig(
        level=server.log_level.upper() if server.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import torch

    from mlaserve.llm_engine import LLMEngine

    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    try:
        engine = LLMEngine(settings.engine)
        try:
            engine.warmup()
        finally:
            engine.shutdown()
    except Exception:
        logger.exception("precompile: the engine failed to start")
        return 1
    cache = engine.jit_cache
    print("mlaserve precompile: done", file=out)
    print(
        f"  cache: {cache.root}"
        if cache is not None
        else "  cache: --cache-dir not set; each "
        "library's own folder (Triton ~/.triton/cache, Inductor /tmp/torchinductor_USER, ...)",
        file=out,
    )
    print(f"  JIT compilations during warm-up: {engine.startup.num_compiles}", file=out)
    print(f"  kernels loaded from the cache: {engine.compile_watch.num_cache_loads}", file=out)
    print(f"  {engine.startup.describe()}", file=out)
    return 0
