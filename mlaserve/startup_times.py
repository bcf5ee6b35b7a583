"""`StartupTimes`: where an engine's start-up went, one named phase at a time.

    server_start        `mlaserve serve`: the server process's start to its spawn of the engine
                        process (the interpreter, option parsing, the model folder's checks),
                        reported by the server; it precedes the engine process, so the total
                        (server start -> ready) includes it
    process_start       the process's start to the engine's construction (the interpreter, the
                        imports; torch's own import is its phase when the engine process makes
                        it, as `mlaserve serve`'s does)
    torch_import        `import torch` (absent where torch came before the engine: `LLM()`)
    tokenizer           the tokenizer's files (transformers' import too, unless deferred)
    tp_start            tensor parallelism: the worker processes spawned, the groups joined
    device_init         the CUDA context (nothing on the CPU)
    model_construction  the modules built on the device, weights uninitialised
    weight_read         the checkpoint read into them (its bytes and GB/s); dummy weights: filled
    weight_postprocess  `process_weights_after_loading` (fused and transposed copies)
    kernel_warmup       the decode GEMV and MoE kernels run once per token count they take (their
                        JIT compiles, or their loads from the on-disk cache), on threads; on one
                        GPU they run in the background from the KV pool's allocation on, and
                        this phase is the wait for them before the first capture
    kv_pool             the KV pool sized and allocated, the attention backend, the buffers
    warmup              the throwaway request (every JIT compile) and the graphs' eager runs
    capture             the CUDA graphs' capture (decode, prefill pieces, MTP draft)

Each phase is one timed interval of this process (`phase()`), none inside another, so the
phases sum to no more than `total_s`, the process's age when the engine is ready; the rest
(`other_s`) is what no phase covers. The engine fills one (`LLMEngine.startup`), logs
`describe()` when warm-up ends, and sends `seconds()` to the server's /metrics
(`mlaserve:startup_duration_seconds{phase=...}`). Only the engine's own process is timed: a
tensor-parallel worker's start-up runs in parallel and shows in rank 0's `tp_start` and in the
phases that wait for the workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["PHASES", "StartupTimes", "process_age_s"]

PHASES = (
    "server_start",
    "process_start",
    "torch_import",
    "tokenizer",
    "tp_start",
    "device_init",
    "model_construction",
    "weight_read",
    "weight_postprocess",
    "kernel_warmup",
    "kv_pool",
    "warmup",
    "capture",
)
_LABELS = {
    "server_start": "server start",
    "process_start": "process start",
    "torch_import": "torch import",
    "tp_start": "TP workers",
    "device_init": "device init",
    "model_construction": "model construction",
    "weight_read": "weight read",
    "weight_postprocess": "weight post-processing",
    "kernel_warmup": "kernel warm-up",
    "kv_pool": "KV pool",
    "warmup": "warm-up",
}


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc), or None where that is not known."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # Field 22 (starttime, clock ticks since boot) follows the command name, which is
            # parenthesised and may hold spaces: count from the last ')'.
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class StartupTimes:
    """Seconds per phase, filled while the engine starts; `mark_ready()` ends it."""

    _seconds: dict[str, float] = field(default_factory=dict)
    weight_bytes: int = 0  # the checkpoint bytes this process read (0: dummy weights)
    total_s: float | None = None  # the process's age at `mark_ready()`
    num_compiles: int | None = None  # JIT compilations during start-up (the compile watch)
    _clock_start: float = field(default_factory=time.perf_counter)

    def add(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r}; expected one of {PHASES}")
        if seconds < 0:
            raise ValueError(f"{phase}: negative duration {seconds}")
        self._seconds[phase] = self._seconds.get(phase, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name` (added to what that phase already holds)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def seconds(self) -> dict[str, float]:
        """Phase -> seconds, in `PHASES` order, only the phases that ran."""
        return {p: self._seconds[p] for p in PHASES if p in self._seconds}

    def mark_ready(self, num_compiles: int | None = None) -> None:
        """The engine is ready: total = the process's age now (else the time since this object
        was made, where the process's start is unknown) plus `server_start` (the server's time
        before it spawned this process), and `process_start` is what came before the engine's
        construction (less torch's import, its own phase)."""
        since_construction = time.perf_counter() - self._clock_start
        age = process_age_s()
        own = since_construction if age is None else max(age, since_construction)
        before = own - since_construction - self._seconds.get("torch_import", 0.0)
        if age is not None and "process_start" not in self._seconds:
            self._seconds["process_start"] = max(0.0, before)
        self.total_s = own + self._seconds.get("server_start", 0.0)  # another process's time
        # /proc's clock ticks are 10 ms: never report phases longer than their total.
        self.total_s = max(self.total_s, sum(self._seconds.values()))
        self.num_compiles = num_compiles

    def phase_seconds(self) -> dict[str, float]:
        """What /metrics shows: every phase that ran and `other`, which sum to the total; empty
        until `mark_ready()`."""
        if self.total_s is None:
            return {}
        return {**self.seconds(), "other": self.other_s}

    @property
    def other_s(self) -> float:
        total = self.total_s if self.total_s is not None else sum(self._seconds.values())
        return max(0.0, total - sum(self._seconds.values()))

    @property
    def weight_read_gbps(self) -> float | None:
        read = self._seconds.get("weight_read")
        if not self.weight_bytes or not read:
            return None
        return self.weight_bytes / read / 1e9

    def describe(self) -> str:
        """The start-up log line: the total, each phase, the weights' rate, the compiles."""
        parts = []
        for phase, s in self.seconds().items():
            text = f"{_LABELS.get(phase, phase)} {s:.2f} s"
            if phase == "weight_read" and self.weight_bytes:
                rate = self.weight_read_gbps
                text += f" ({self.weight_bytes / 1e9:.3f} GB" + (
                    f", {rate:.2f} GB/s)" if rate is not None else ")"
                )
            parts.append(text)
        parts.append(f"other {self.other_s:.2f} s")
        total = f"{self.total_s:.2f} s" if self.total_s is not None else "?"
        line = f"start-up: {total} to ready: " + ", ".join(parts)
        if self.num_compiles is not None:
            line += f"; {self.num_compiles} JIT compilations"
        return line
