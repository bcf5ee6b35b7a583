"""Stop strings: find where generated text must end, and how much of it streaming must hold back."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["find_stop", "stop_holdback"]


def find_stop(
    text: str, new_len: int, stops: Sequence[str], include_stop: bool
) -> tuple[int, str] | None:
    """Find the stop string completed by the last `new_len` characters of `text`.

    Only occurrences that end inside the new characters are looked at (earlier text was checked
    on earlier steps). If several stops complete there, the one that completes FIRST wins, as
    if the text had arrived one character at a time; this keeps the result independent of how
    the text was split into steps. Among stops ending at the same place the longest wins.

    Returns (truncate_at, stop_str): the output is `text[:truncate_at]`, which ends just before
    the stop string, or just after it when `include_stop`. None if no stop string completed.
    """
    if new_len <= 0 or not stops:
        return None
    new_start = max(len(text) - new_len, 0)
    best: tuple[int, int, str] | None = None  # (end, start, stop): first end, then longest
    for stop in stops:
        # The earliest occurrence that includes at least one new character.
        start = text.find(stop, max(new_start - len(stop) + 1, 0))
        if start == -1:
            continue
        candidate = (start + len(stop), start, stop)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None
    end, start, stop = best
    return (end if include_stop else start), stop


def stop_holdback(stops: Sequence[str], include_stop: bool) -> int:
    """How many trailing characters a stream must hold back so that it never sends the start of
    a stop string that later turns out to be removed (vLLM's stop_buffer_length). Not needed
    when stop strings are kept in the output."""
    if include_stop or not stops:
        return 0
    return max(len(s) for s in stops) - 1
