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
    event once the copy out of the row is enqueued; `before_write(row)` waits for the last
    one. `make_event`: the event factory (None on CPU: copies there are synchronous); tests
    pass events they control."""

    def __init__(self, num_rows: int, make_event: Callable[[], Any] | None) -> None:
        self._events = [make_event() if make_event is not None else None for _ in range(num_rows)]
        self._armed = [False] * num_rows
        self.num_blocking_waits = 0  # writes that had to wait for the device (0 under rule 1)

    @classmethod
    def for_device(cls, num_rows: int, device: torch.device) -> RowFences:
        return cls(num_rows, torch.cuda.Event if device.type == "cuda" else None)

    def before_write(self, row: int) -> None:
        event = self._events[row]
        if event is None or not self._armed[row]:
            return
        if not event.query():
            self.num_blocking_waits += 1
            event.synchronize()
        self._armed[row] = False

    def after_copy(self, row: int, stream: Any | None = None) -> None:
        event = self._events[row]
        if event is None:
            return
        if stream is not None:
            event.record(stream)
        else:
            event.record()
        self._armed[row] = True
