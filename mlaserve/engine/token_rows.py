"""`TokenRows`: where `ModelRunner.build_host_batch` collects a step's token rows."""

from __future__ import annotations

import numpy as np

__all__ = ["TokenRows"]


class TokenRows:
    """A host batch's token rows (ids, positions, KV write slots) as `build_host_batch` appends
    them: decode rows one at a time into lists, a prompt chunk's range as arrays. A batch of
    decodes alone stays in lists (a few rows: no array to build); one with a chunk comes out
    as int64 arrays, which `InputBuffers.fill` stages in one copy each instead of converting
    each row's Python ints."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.count = 0  # rows so far
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add_one(self, token_id: int, position: int, slot: int) -> None:
        self.ids.append(token_id)
        self.positions.append(position)
        self.slots.append(slot)
        self.count += 1

    def add_range(self, token_ids: list[int], start: int, pages: list[int], page_size: int):
        """A chunk's rows: positions start.., their slots in `pages`."""
        self._flush()
        positions = np.arange(start, start + len(token_ids))
        page = positions // page_size
        first = page[0]
        table = np.asarray(pages[first : page[-1] + 1], dtype=np.int64)
        slots = table[page - first] * page_size + positions % page_size
        self._parts.append((np.asarray(token_ids, dtype=np.int64), positions, slots))
        self.count += len(token_ids)

    def _flush(self) -> None:
        if self.ids:
            as_array = (
                np.asarray(x, dtype=np.int64) for x in (self.ids, self.positions, self.slots)
            )
            self._parts.append(tuple(as_array))  # type: ignore[arg-type]
            self.ids, self.positions, self.slots = [], [], []

    def rows(self) -> tuple:
        """-> (ids, positions, slots): lists for decodes alone, else int64 arrays."""
        if not self._parts:
            return self.ids, self.positions, self.slots
        self._flush()
        if len(self._parts) == 1:
            return self._parts[0]
        return tuple(np.concatenate(column) for column in zip(*self._parts))
