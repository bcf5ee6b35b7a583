"""What DeepSeek-V3's and Kimi-K2's tool-call formats share: content, then a section of calls
between two markers, each call opening with a marker of its own.

    [content]SECTION_BEGIN CALL_BEGIN ... CALL_BEGIN ... SECTION_END[content]

A subclass names the three markers and reads one call: its `_head` state (entered after
CALL_BEGIN) and the states it leads to, each a method `_<state>(buf, out)` that consumes a
prefix of `buf` (returns its length) or waits for more text (None); and `_finish_call`, what a
call cut short at the end of the output leaves. Calls are only looked for before the first one
is made; content after the section stays content. A piece that could be the start of a marker
is held until the next `feed` tells (`tool_parse.py`: one state machine for streamed and not).
"""

from __future__ import annotations

import uuid
from typing import ClassVar

from mlaserve.service.parsers.markers import partial_marker_len
from mlaserve.service.parsers.tool_parse import ToolCallDelta, ToolParse

__all__ = ["SectionedCallsParser"]


class SectionedCallsParser:
    SECTION_BEGIN: ClassVar[str]
    SECTION_END: ClassVar[str]
    CALL_BEGIN: ClassVar[str]
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self._state = "content"
        self._pending = ""
        self._index = -1  # of the call being read
        self.num_calls = 0

    def feed(self, text: str) -> ToolParse:
        out = ToolParse()
        buf = self._pending + text
        while (consumed := getattr(self, f"_{self._state}")(buf, out)) is not None:
            buf = buf[consumed:]
        self._pending = buf
        return out

    def finish(self) -> ToolParse:
        """At the end of the output: release what was held."""
        out = ToolParse()
        pending, self._pending = self._pending, ""
        if self._state == "content":
            out.content = pending
        else:
            self._finish_call(pending, out)
        return out

    def _finish_call(self, pending: str, out: ToolParse) -> None:
        raise NotImplementedError

    def _content(self, buf: str, out: ToolParse) -> int | None:
        if self.num_calls == 0:
            found = [i for i in (buf.find(self.SECTION_BEGIN), buf.find(self.CALL_BEGIN)) if i >= 0]
            if found:
                start = min(found)
                out.content += buf[:start]
                self._state = "between"
                at_section = buf.startswith(self.SECTION_BEGIN, start)
                return start + (len(self.SECTION_BEGIN) if at_section else 0)
        held = 0
        if self.num_calls == 0:
            held = partial_marker_len(buf, self.SECTION_BEGIN, self.CALL_BEGIN)
        out.content += buf[: len(buf) - held]
        return None if len(buf) == 0 or held == len(buf) else len(buf) - held

    def _between(self, buf: str, out: ToolParse) -> int | None:
        rest = buf.lstrip()
        skipped = len(buf) - len(rest)
        if rest.startswith(self.CALL_BEGIN):
            self._state = "head"
            return skipped + len(self.CALL_BEGIN)
        if rest.startswith(self.SECTION_END):
            self._state = "content"
            return skipped + len(self.SECTION_END)
        if not rest or self.CALL_BEGIN.startswith(rest) or self.SECTION_END.startswith(rest):
            return None
        self._state = "content"  # not the format: the rest is content
        return 0

    def _start_call(self, name: str, out: ToolParse, call_id: str | None = None) -> None:
        self._index = self.num_calls
        self.num_calls += 1
        call_id = call_id or f"call_{uuid.uuid4().hex[:24]}"
        out.calls.append(ToolCallDelta(self._index, id=call_id, name=name))
