"""DeepSeek-V3's tool calls, read from the model's own marker tokens.

DeepSeek-V3 / R1 write a turn with tool calls as (one line here; `\\n` is a newline):

    [content]<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
    ARGUMENTS\\n```<｜tool▁call▁end｜>[more calls]<｜tool▁calls▁end｜>

each marker one token of the published tokenizer (not a special token, so it survives
`skip_special_tokens`). This is the format vLLM's `deepseek_v3` tool parser and SGLang's
`deepseekv3` detector read. Text before the first marker is `content`; the ARGUMENTS of each
call are passed through as the model wrote them (a JSON object), not re-serialised, so the
streamed pieces of a call add up to exactly the non-streamed `arguments`.

One state machine serves both modes: the non-streaming answer is every piece of one `feed` of
the whole text plus `finish`, so streaming and not cannot disagree. A piece that could be the
start of a marker (or of the closing fence) is held until the next `feed` tells.
"""

from __future__ import annotations

import re

from mlaserve.service.parsers.markers import partial_marker_len
from mlaserve.service.parsers.sectioned_calls import SectionedCallsParser
from mlaserve.service.parsers.tool_parse import ToolCallDelta, ToolParse

__all__ = ["DeepSeekV3ToolParser"]

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE_OPEN = "```json\n"
# The closing fence. JSON cannot hold it (a newline inside a string is escaped), so it ends the
# arguments even when what follows is cut short (a length cut inside the end marker).
FENCE_CLOSE = "\n```"
# Whitespace and up to three backticks at the end of the arguments: maybe the closing fence.
_FENCE_TAIL = re.compile(r"\s*`{0,3}\Z")


class DeepSeekV3ToolParser(SectionedCallsParser):
    """The state of one choice's output; one instance per choice (`tool_parse.ToolParser`).
    States past `sectioned_calls.py`'s: head (type<｜tool▁sep｜>name\\n), fence (```json\\n),
    arguments (the JSON, up to \\n```<｜tool▁call▁end｜>), closing (after the closing fence: up
    to <｜tool▁call▁end｜>)."""

    SECTION_BEGIN = CALLS_BEGIN
    SECTION_END = CALLS_END
    CALL_BEGIN = CALL_BEGIN
    keeps_special_tokens = False  # the markers are ordinary tokens of V3's tokenizer

    def _finish_call(self, pending: str, out: ToolParse) -> None:
        """A call cut short keeps its text; a call without a name is no call."""
        if self._state == "head" and SEP in pending:
            name = pending.split(SEP, 1)[1].strip()
            if name:
                self._start_call(name, out)
        elif self._state == "arguments":
            # Held back: maybe the start of the closing fence, or of the end marker.
            args = pending[: len(pending) - partial_marker_len(pending, CALL_END)]
            args = args[: len(args) - len(_FENCE_TAIL.search(args).group())]  # type: ignore[union-attr]
            if args:
                out.calls.append(ToolCallDelta(self._index, arguments=args))

    # ----- one step per state: consume a prefix of `buf` (its length) or wait (None) -----
    def _head(self, buf: str, out: ToolParse) -> int | None:
        sep = buf.find(SEP)
        if sep < 0:
            return None
        newline = buf.find("\n", sep)
        if newline < 0:
            return None
        self._start_call(buf[sep + len(SEP) : newline].strip(), out)
        self._state = "fence"
        return newline + 1

    def _fence(self, buf: str, out: ToolParse) -> int | None:
        if buf.startswith(FENCE_OPEN):
            self._state = "arguments"
            return len(FENCE_OPEN)
        if FENCE_OPEN.startswith(buf):
            return None
        self._state = "arguments"  # no fence: the arguments follow the name directly
        return 0

    def _arguments(self, buf: str, out: ToolParse) -> int | None:
        end = buf.find(CALL_END)
        fence = buf.find(FENCE_CLOSE)
        if fence >= 0 and (end < 0 or fence < end):
            args = buf[:fence].rstrip()
            if args:
                out.calls.append(ToolCallDelta(self._index, arguments=args))
            self._state = "closing"
            return fence + len(FENCE_CLOSE)
        if end >= 0:
            args = buf[:end].rstrip()
            args = args.removesuffix("```").rstrip()
            if args:
                out.calls.append(ToolCallDelta(self._index, arguments=args))
            self._state = "between"
            return end + len(CALL_END)
        body = buf[: len(buf) - partial_marker_len(buf, CALL_END)]
        ready = len(body) - len(_FENCE_TAIL.search(body).group())  # type: ignore[union-attr]
        if ready <= 0:
            return None
        out.calls.append(ToolCallDelta(self._index, arguments=buf[:ready]))
        return ready

    def _closing(self, buf: str, out: ToolParse) -> int | None:
        end = buf.find(CALL_END)
        if end < 0:
            return None  # dropped by `finish` if the end marker never comes
        self._state = "between"
        return end + len(CALL_END)
