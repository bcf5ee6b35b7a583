"""The rules overlap scheduling rests on, and the objects that enforce them.

With overlap scheduling (`LLMEngine`, on with CUDA) the host launches step N+1 before it reads
step N's tokens back, so host memory the device still reads, and device memory the next step
reads, change hands while work is queued. Correctness rests on these rules; each is enforced
where it lives, and each has a test (tests/engine/test_overlap_rules.py) that fails when it is
broken.

1. **At most one step in flight.** A step is in flight from its launch until the host waited on
   it: on its read-back (the sampled tokens), or, for a step that samples nothing (a middle
   chunk of a long prompt), on its `StepFence`. Every step has one or the other, and a step is
   launched only once every step before the one just launched has been waited on
   (`StepLedger`). Without a wait on steps that sample nothing, the host ran ahead of the
   device through a long prompt's chunks and rewrote a pinned staging row whose upload was
   still queued: the device then ran a step on a later step's inputs (issue 40: a gather out of
   bounds on an H100, under `LLMEngine._resolve`).
2. **A pinned staging row is the device's from the copy out of it until that copy is done.**
   Host->device inputs go through pinned rows used in turn (`InputBuffers`, the sampler's step
   counts in `SamplingSlots`). `RowFences` records an event after each copy and waits for it
   before the host writes the row again. Under rule 1 that wait never blocks
   (`RowFences.num_blocking_waits` stays 0, which the GPU tests check); it is what keeps a
   broken rule 1 from corrupting inputs silently.
3. **At most two read-backs per host wait.** Device->host results land in two pinned rows used
   in turn (`ModelRunner.start_read_back`); a speculative EXTEND step already uses both. A
   `ReadBack` knows the row's generation when it started, and raises `OverlapError` if the row
   was reused before it was read (its values would be another step's).
4. **Future token ids are read by the step launched right after the one that sampled them.** A
   pending token lives on the device (`PendingSample.feed`: for a graphed decode step, the
   graph's static output, which the next replay of a graph sharing its pool overwrites). The
   next step's `fill` copies it into its input ids in stream order before that step's
   forward; `build_host_batch` checks that each pending row belongs to the step in flight
   (`Request.pending_step`), so no later step ever reads a feed that was overwritten.
5. **A request whose token is still pending is not (re)admitted.** A request preempted while
   its last token is on the device goes back to the queue; recomputing it before that token
   resolves would build its prompt without it. The scheduler skips such a request
   (`Scheduler.schedule`), independently of the break after a preemption that also keeps it
   out today.

Errors here are engine bugs, not user errors: they name the request and the step, and end the
engine cleanly (the server then exits non-zero) instead of a device-side assert.
"""

from __future__ import annotations

from typing import Any

import torch

from mlaserve.row_fences import RowFences

__all__ = ["OverlapError", "RowFences", "StepFence", "StepLedger"]


class OverlapError(RuntimeError):
    """An overlap-scheduling rule (this module's docstring) was broken: an engine bug."""


class StepFence:
    """A point in the device's stream the host can wait on: recorded after a step's last
    device work (None on CPU, where every copy and kernel has already run)."""

    __slots__ = ("_event",)

    def __init__(self, event: Any | None) -> None:
        self._event = event

    @classmethod
    def record(cls, device: torch.device) -> StepFence:
        if device.type != "cuda":
            return cls(None)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return cls(event)

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class StepLedger:
    """Rule 1: which steps were launched and which the host has waited on. Step ids count
    from 1; `launch` refuses a step while a step older than the last one is unwaited."""

    def __init__(self) -> None:
        self.last_launched = 0
        self._unwaited: set[int] = set()
        self.max_in_flight = 0  # the most steps ever in flight at once (tests read it)

    def launch(self) -> int:
        step = self.last_launched + 1
        stale = [s for s in self._unwaited if s < self.last_launched]
        if stale:
            raise OverlapError(
                f"step {step} launched while step {min(stale)} was never waited on: at most "
                "one step may be in flight (overlap rule 1)"
            )
        self.last_launched = step
        self._unwaited.add(step)
        self.max_in_flight = max(self.max_in_flight, len(self._unwaited))
        return step

    def waited(self, step: int) -> None:
        self._unwaited.discard(step)

    @property
    def in_flight(self) -> int:
        return len(self._unwaited)
