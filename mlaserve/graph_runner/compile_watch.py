"""Counts just-in-time compilations in this process, so a compile while serving (a stall of
seconds to minutes in the middle of someone's request) shows up as a metric instead of a mystery.

Sources:
- Triton kernels (ours, and torch.compile's Inductor kernels): `triton.knobs.runtime.
  jit_post_compile_hook`, chained to any hook already installed. It fires for every kernel a
  process builds, including ones Triton then finds in its on-disk cache: either way the step that
  triggered it paid for it.
- torch.compile graphs: dynamo's `unique_graphs` counter.

Of the Triton kernels, those Triton compiled (a miss of its on-disk cache, `TRITON_CACHE_DIR`:
`--cache-dir`) and those it loaded from that cache are told apart through Triton's compilation
listener (`triton.knobs.compilation.listener`, its `cache_hit` argument; Triton >= 3.4), chained
to any listener already installed: `num_compiled` and `num_cache_loads`. A start on a filled
cache loads every kernel and compiles none (issue 44: "the compile watch logs 0").

Warm-up before `/ready` exists to make every compilation happen at start-up; `mark_ready()`
takes the baseline and `compiles_since_ready` should stay 0 while serving.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

__all__ = ["CompileWatch"]

logger = logging.getLogger(__name__)


class CompileWatch:
    _newest: CompileWatch | None = None

    def __init__(self) -> None:
        CompileWatch._newest = self
        self._lock = threading.Lock()
        self._triton = 0
        self.num_compiled = 0  # Triton kernels compiled (cache misses); torch.compile graphs too
        self.num_cache_loads = 0  # Triton kernels loaded from the on-disk cache
        self._listening = False  # whether Triton reports cache hits (its listener knob)
        self._baseline = 0
        self._ready = False
        self.sources: list[str] = ["torch.compile"]
        try:
            from triton import knobs
        except ImportError:  # no Triton (CPU builds of torch): nothing to compile
            return
        previous = knobs.runtime.jit_post_compile_hook

        def hook(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._triton += 1
                serving = self._ready
            # Which kernel and specialisation warm-up missed. Only the newest watch reports: in a
            # process with several engines (benchmarks, tests) an older one's hook also sees the
            # newer engines' start-up compiles.
            if serving and CompileWatch._newest is self:
                logger.warning("JIT compile while serving: %s", kwargs.get("repr", "?"))
            if previous is not None:
                return previous(*args, **kwargs)
            return None

        knobs.runtime.jit_post_compile_hook = hook
        self.sources.append("triton")
        self._listen(knobs)

    def _listen(self, knobs: Any) -> None:
        """Count compiles and cache loads apart, where Triton has a compilation listener."""
        compilation = getattr(knobs, "compilation", None)
        if compilation is None or not hasattr(compilation, "listener"):
            return
        previous = compilation.listener

        def listener(**kwargs: Any) -> None:
            self.record_build(cache_hit=bool(kwargs.get("cache_hit")))
            if previous is not None:
                previous(**kwargs)

        compilation.listener = listener
        self._listening = True

    def record_build(self, cache_hit: bool, count: int = 1) -> None:
        """`count` Triton kernels built: loaded from the on-disk cache (`cache_hit`) or
        compiled (also: by start-up's worker processes, `kernel_compile_pool.py`, whose
        kernels this process then loads)."""
        with self._lock:
            if cache_hit:
                self.num_cache_loads += count
            else:
                self.num_compiled += count

    @property
    def compiled(self) -> int:
        """JIT compilations proper: Triton cache misses (every Triton build where Triton does
        not say which) and torch.compile graphs."""
        triton = self.num_compiled if self._listening else self._triton
        return triton + _dynamo_graphs()

    @property
    def total(self) -> int:
        return self._triton + _dynamo_graphs()

    def mark_ready(self) -> None:
        self._baseline = self.total
        self._ready = True
        logger.info(
            "compile watch: %d JIT compilations during start-up (%s)%s",
            self.compiled,
            ", ".join(self.sources),
            f"; {self.num_cache_loads} kernels loaded from the on-disk cache"
            if self._listening
            else "",
        )

    @property
    def compiles_since_ready(self) -> int:
        return self.total - self._baseline


def _dynamo_graphs() -> int:
    # Only if torch.compile was ever used: importing dynamo just to read 0 costs a second.
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])
