"""Events that say when the device is done copying out of a pinned host row.

A leaf module (torch only), so the sampling layer below the model can use it as well as the
engine: overlap scheduling's rule 2 (`mlaserve/engine/overlap.py`) is enforced with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RowFences"]


class RowFences:
    """Rule 2 for `num_rows` pinned staging rows used in turn: `after_copy(row)` records an
    event once the copy out of the row is enqueued; `before_write(row)` waits for it. An event
    never recorded, or already waited on, reads as done. `make_event`: the event factory (None
    on CPU: copies there are synchronous); tests pass events they control."""

    def __init__(
        self,
        num_rows: int,
        make_event: Callable[[], Any] | None,
        device_index: int | None = None,
    ) -> None:
        self._events = [make_event() if make_event is not None else None for _ in range(num_rows)]
        # Events record on this device's current stream, found by index: torch's lookup of the
        # current device is a sizeable cost on a host-bound step (model_runner.py; bench/RESULTS.md,
        # "Where a default-model decode step's host time went").
        self._device_index = device_index
        self.num_blocking_waits = 0  # writes that had to wait for the device (0 under rule 1)

    @classmethod
    def for_device(cls, num_rows: int, device: torch.device) -> RowFences:
        if device.type != "cuda":
            return cls(num_rows, None)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return cls(num_rows, torch.cuda.Event, index)

    def before_write(self, row: int) -> None:
        event = self._events[row]
        if event is not None and not event.query():
            self.num_blocking_waits += 1
            event.synchronize()

    def after_copy(self, row: int) -> None:
        event = self._events[row]
        if event is not None:
            index = self._device_index
            event.record(None if index is None else torch.cuda.current_stream(index))
