"""Finding marker strings in text that arrives in pieces."""

from __future__ import annotations

__all__ = ["partial_marker_len"]


def partial_marker_len(text: str, *markers: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`:
    text that must be held back, because the next piece may complete a marker. A model writes
    each DeepSeek marker as one token, so this is almost always 0; it matters when the markers
    are spelled by ordinary tokens (a prompt-engineered model, a fine-tune without them)."""
    held = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), held, -1):
            if text.endswith(marker[:n]):
                held = n
                break
    return held
