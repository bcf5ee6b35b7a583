"""A request's generated text, grown by per-step deltas.

A `str` attribute grown with `+=` is copied whole on every step (CPython extends a string in
place only when nothing else references it, and an attribute always does): O(length) host work
per token, O(length^2) over a generation. Here a step appends its delta to a list, and what a
step reads back (the tail that a stop string may end in, the text not yet streamed) walks the
list from the end: O(what is read). The whole text is joined only when it is asked for
(cumulative outputs, the final output), and the joined string is kept, so joins do not repeat.
"""

from __future__ import annotations

__all__ = ["OutputText"]


class OutputText:
    __slots__ = ("_length", "_pieces")

    def __init__(self) -> None:
        self._pieces: list[str] = []  # concatenated in order: the text
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def __str__(self) -> str:
        """The whole text. O(length) the first time after an append, then O(1)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def __repr__(self) -> str:
        return f"OutputText({str(self)!r})"

    def append(self, delta: str) -> None:
        if delta:
            self._pieces.append(delta)
            self._length += len(delta)

    def tail(self, start: int) -> str:
        """text[start:] for 0 <= start: O(length - start), plus the piece it starts in."""
        need = self._length - max(start, 0)
        if need <= 0:
            return ""
        parts, got, i = [], 0, len(self._pieces)
        while got < need:
            i -= 1
            parts.append(self._pieces[i])
            got += len(self._pieces[i])
        parts.reverse()
        text = "".join(parts)
        return text[got - need :] if got > need else text

    def truncate(self, length: int) -> None:
        """Keep text[:length] (a stop string cut off): O(what is removed)."""
        length = max(length, 0)
        while self._length > length:
            last = self._pieces.pop()
            self._length -= len(last)
            if self._length < length:
                self._pieces.append(last[: length - self._length])
                self._length = length
