"""A request's generated text, grown by per-step deltas.

A `str` attribute grown with `+=` is copied whole on every step (CPython extends a string in
place only when nothing else references it, and an attribute always does): O(length) host work
per token, O(length^2) over a generation. Here the text is split in two: a bounded `tail` string
that deltas are appended to and that every per-step read lands in (the text a stop string may
end in, the text not yet streamed), and the older text as chunks, moved out of the tail
`_KEEP` characters at a time and joined only when the whole text is asked for (a cumulative or
final output). Per step that is O(_KEEP) at worst, whatever the length; a read reaching further
back than the tail (a stop string longer than `_KEEP`) is still correct, only O(length).
"""

from __future__ import annotations

__all__ = ["OutputText"]

# Characters that stay in the tail after a spill; the tail holds at most 2 * _KEEP. Stop
# strings and the streaming holdback (the longest stop string) are far shorter in practice.
_KEEP = 512


class OutputText:
    __slots__ = ("_head", "_head_len", "_tail")

    def __init__(self) -> None:
        self._head: list[str] = []  # older text, in order: text = "".join(head) + tail
        self._head_len = 0
        self._tail = ""

    def __len__(self) -> int:
        return self._head_len + len(self._tail)

    def __str__(self) -> str:
        """The whole text: O(length). The joined head is kept, so the next call joins less."""
        if len(self._head) > 1:
            self._head = ["".join(self._head)]
        return self._head[0] + self._tail if self._head else self._tail

    def __repr__(self) -> str:
        return f"OutputText({str(self)!r})"

    def append(self, delta: str) -> None:
        tail = self._tail + delta
        if len(tail) > 2 * _KEEP:
            cut = len(tail) - _KEEP
            self._head.append(tail[:cut])
            self._head_len += cut
            tail = tail[cut:]
        self._tail = tail

    def tail(self, start: int) -> str:
        """text[start:] (0 <= start): one slice of the tail when it starts there."""
        k = start - self._head_len
        return self._tail[k:] if k >= 0 else str(self)[start:]

    def truncate(self, length: int) -> None:
        """Keep text[:length] (a stop string cut off)."""
        k = length - self._head_len
        if k >= 0:
            self._tail = self._tail[:k]
            return
        text = str(self)[: max(length, 0)]
        self._head, self._head_len, self._tail = [], 0, ""
        self.append(text)
