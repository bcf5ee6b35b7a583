"""Counts just-in-time compilations in this process, so a compile while serving (a stall of
seconds to minutes in the middle of someone's request) shows up as a metric instead of a mystery.

Sources:
- Triton kernels (ours, and torch.compile's Inductor kernels): `triton.knobs.runtime.
  jit_post_compile_hook`, chained to any hook already installed. It fires for every kernel a
  process builds, including ones Triton then finds in its on-disk cache: either way the step that
  triggered it paid for it.
- torch.compile graphs: dynamo's `unique_graphs` counter.

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

    @property
    def total(self) -> int:
        return self._triton + _dynamo_graphs()

    def mark_ready(self) -> None:
        self._baseline = self.total
        self._ready = True
        logger.info(
            "compile watch: %d JIT compilations during start-up (%s)",
            self._baseline,
            ", ".join(self.sources),
        )

    @property
    def compiles_since_ready(self) -> int:
        return self.total - self._baseline


def _dynamo_graphs() -> int:
    # Only if torch.compile was ever used: importing dynamo just to read 0 costs a second.
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])
