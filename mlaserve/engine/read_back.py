"""A step's device->host read-back: the pinned rows it lands in, the copy in flight
(`ReadBack`), the sampled tokens on their way (`PendingSample`) and what the host gets
(`StepResult`), and the launched step they belong to until the host waits on it
(`InFlightStep`). The only device->host transfer of a step (overlap rules 1 and 3,
`engine/overlap.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlaserve.engine.overlap import OverlapError, StepFence
from mlaserve.engine.scheduler import SchedulerOutput
from mlaserve.sampling import SamplerOutput

__all__ = [
    "NONFINITE_LOGITS",
    "InFlightStep",
    "PendingSample",
    "ReadBack",
    "ReadBackRows",
    "StepResult",
]

NONFINITE_LOGITS = "the model produced NaN or infinite logits for this request"


@dataclass
class StepResult:
    """Per sampled request (in scheduling order): the tokens this step emits (one without
    speculation, 1..k+1 with it) and, per emitted token, optional logprob info."""

    token_ids: list[list[int]]
    logprobs: list[list[float]] | None = None
    ranks: list[list[int]] | None = None
    top_ids: list[list[list[int]]] | None = None
    top_logprobs: list[list[list[float]]] | None = None
    # Per row: None, or why the row produced no token (e.g. NaN/inf logits). The engine finishes
    # such a request with that error instead of appending a token.
    errors: list[str | None] | None = None


class ReadBackRows:
    """Two pinned int64 rows and their events, used in turn (`start`), so one read-back may
    still be pending while the next step starts its own. Each row's generation counts its
    uses: a read-back whose row was reused before it was read fails (overlap rule 3)."""

    def __init__(self, num_values: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        self._host = [torch.empty(num_values, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._ready = [torch.cuda.Event() if pin else None for _ in range(2)]
        self.generation = [0, 0]
        # The device's index, so the read-back finds its stream without torch's current-device
        # lookup (it checks CUDA's availability: a cost on a host-bound step).
        self._device_index = (
            (device.index if device.index is not None else torch.cuda.current_device())
            if pin
            else None
        )
        self._turn = 0
        self.num_host_waits = 0  # how often a step waited on the device (tests count it)

    def start(self, values: torch.Tensor) -> ReadBack:
        """Start the copy of `values` (int64, any shape) into the next pinned row."""
        turn = self._turn
        self._turn ^= 1
        self.generation[turn] += 1
        if values.numel() > self._host[turn].numel():
            pin = self.device.type == "cuda"
            self._host[turn] = torch.empty(values.numel(), dtype=torch.int64, pin_memory=pin)
        host = self._host[turn][: values.numel()].view(values.shape)
        host.copy_(values, non_blocking=True)
        event = self._ready[turn]
        if event is not None:
            event.record(torch.cuda.current_stream(self._device_index))
        return ReadBack(self, host, event, turn, self.generation[turn])


@dataclass
class ReadBack:
    """A device->host copy in flight (`ReadBackRows.start`)."""

    rows: ReadBackRows
    host: torch.Tensor  # pinned, being written by the copy
    event: torch.cuda.Event | None  # recorded after the copy (None on CPU: already done)
    turn: int  # which of the two pinned rows
    generation: int  # that row's use count when this read-back started

    def wait(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        if self.rows.generation[self.turn] != self.generation:
            raise OverlapError(
                "a read-back row was reused before it was read: more than two read-backs per "
                "host wait (overlap rule 3)"
            )
        self.rows.num_host_waits += 1
        return self.host.tolist()


@dataclass
class PendingSample:
    """A step's sampled tokens on their way to the host (`ModelRunner.sample_async`)."""

    read_back: ReadBack | None  # None: the step sampled nothing
    out: SamplerOutput | None  # the sampler's output (logprob tensors, read after the wait)
    fence: StepFence | None = None  # what the host waits on when there is no read-back

    @property
    def feed(self) -> torch.Tensor | None:
        """[n] int64 on the device, >= 0: the next forward's input ids."""
        return self.out.token_ids if self.out is not None else None

    def result(self) -> StepResult:
        """Wait for the tokens (the step's one host sync) and return them."""
        if self.read_back is None:
            if self.fence is not None:
                self.fence.wait()
            return StepResult(token_ids=[])
        ids = self.read_back.wait()
        result = StepResult(token_ids=[[t] for t in ids])
        if min(ids) < 0:
            result.errors = [None if t >= 0 else NONFINITE_LOGITS for t in ids]
        out = self.out
        if out.logprobs is not None:  # some row asked for logprobs
            result.logprobs = [[x] for x in out.logprobs.tolist()]
            result.ranks = [[x] for x in out.ranks.tolist()]
            if out.top_ids is not None:
                result.top_ids = [[x] for x in out.top_ids.tolist()]
                result.top_logprobs = [[x] for x in out.top_logprobs.tolist()]
        return result


@dataclass
class InFlightStep:
    """A launched step the host has not waited on yet: its sampled tokens are still on the
    device, or (it samples nothing) its fence has not been waited on."""

    scheduled: SchedulerOutput  # what it ran
    sample: PendingSample
    step: int  # its `StepLedger` id

    @property
    def samples(self) -> bool:
        """Whether it sampled tokens (whose read-back may end requests)."""
        return self.sample.read_back is not None
