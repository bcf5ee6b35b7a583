"""What a tool-call parser tells, one `feed` or `finish` at a time, and what every parser is.

A parser holds the state of one choice's output (one instance per choice). `feed(text)` takes
the next piece of the detokenized text and returns the content and tool-call pieces it can tell
so far; `finish()` releases what it held at the end. The non-streamed answer is one `feed` of
the whole text plus `finish`, so streaming and not cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

__all__ = ["ToolCallDelta", "ToolParse", "ToolParser"]


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of tool call `index`: its first piece carries `id` and `name`."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ToolParse:
    """What one `feed` or `finish` tells: content text and tool-call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ToolParse) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class ToolParser(Protocol):
    # True where the model's call markers are special tokens of its tokenizer: the request is
    # then detokenized with them (skip_special_tokens=False), or the parser would never see them.
    keeps_special_tokens: ClassVar[bool]
    num_calls: int

    def feed(self, text: str) -> ToolParse: ...

    def finish(self) -> ToolParse: ...
