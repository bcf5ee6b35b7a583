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

import enum
import re
import uuid
from dataclasses import dataclass, field

from mlaserve.service.parsers.markers import partial_marker_len

__all__ = ["DeepSeekV3ToolParser", "ToolCallDelta", "ToolParse"]

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


class _State(enum.Enum):
    CONTENT = "content"  # before the calls (or after them)
    BETWEEN = "between"  # inside <｜tool▁calls▁begin｜>, expecting a call or the end
    HEAD = "head"  # after <｜tool▁call▁begin｜>: type<｜tool▁sep｜>name\n
    FENCE = "fence"  # after the name: ```json\n
    ARGUMENTS = "arguments"  # the JSON, up to \n```<｜tool▁call▁end｜>
    CLOSING = "closing"  # after the closing fence: up to <｜tool▁call▁end｜>


class DeepSeekV3ToolParser:
    """The state of one choice's output; one instance per choice."""

    def __init__(self) -> None:
        self._state = _State.CONTENT
        self._pending = ""
        self._index = -1  # of the call being read
        self._sent_args = ""  # arguments of the current call sent so far
        self.num_calls = 0

    def feed(self, text: str) -> ToolParse:
        out = ToolParse()
        buf = self._pending + text
        while True:
            step = _STEPS[self._state]
            consumed = step(self, buf, out)
            if consumed is None:  # needs more text
                break
            buf = buf[consumed:]
        self._pending = buf
        return out

    def finish(self) -> ToolParse:
        """At the end of the output: release what was held (a call cut short keeps its text)."""
        out = ToolParse()
        pending, self._pending = self._pending, ""
        if self._state is _State.CONTENT:
            out.content = pending
        elif self._state is _State.HEAD and SEP in pending:
            name = pending.split(SEP, 1)[1].strip()
            if name:  # a call without a name is no call
                self._start_call(name, out)
        elif self._state is _State.ARGUMENTS:
            # Held back: maybe the start of the closing fence, or of the end marker.
            args = pending[: len(pending) - partial_marker_len(pending, CALL_END)]
            args = args[: len(args) - len(_FENCE_TAIL.search(args).group())]  # type: ignore[union-attr]
            if args:
                out.calls.append(ToolCallDelta(self._index, arguments=args))
        return out

    # ----- one step per state: consume a prefix of `buf` (its length) or wait (None) -----
    def _content(self, buf: str, out: ToolParse) -> int | None:
        starts = [i for i in (buf.find(CALLS_BEGIN), buf.find(CALL_BEGIN)) if i >= 0]
        if starts and self.num_calls == 0:
            start = min(starts)
            out.content += buf[:start]
            self._state = _State.BETWEEN
            return start + (len(CALLS_BEGIN) if buf.startswith(CALLS_BEGIN, start) else 0)
        held = partial_marker_len(buf, CALLS_BEGIN, CALL_BEGIN) if self.num_calls == 0 else 0
        out.content += buf[: len(buf) - held]
        return None if len(buf) == 0 or held == len(buf) else len(buf) - held

    def _between(self, buf: str, out: ToolParse) -> int | None:
        rest = buf.lstrip()
        skipped = len(buf) - len(rest)
        if rest.startswith(CALL_BEGIN):
            self._state = _State.HEAD
            return skipped + len(CALL_BEGIN)
        if rest.startswith(CALLS_END):
            self._state = _State.CONTENT
            return skipped + len(CALLS_END)
        if not rest or CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest):
            return None
        self._state = _State.CONTENT  # not the format: the rest is content
        return 0

    def _head(self, buf: str, out: ToolParse) -> int | None:
        sep = buf.find(SEP)
        if sep < 0:
            return None
        newline = buf.find("\n", sep)
        if newline < 0:
            return None
        self._start_call(buf[sep + len(SEP) : newline].strip(), out)
        self._state = _State.FENCE
        return newline + 1

    def _fence(self, buf: str, out: ToolParse) -> int | None:
        if buf.startswith(FENCE_OPEN):
            self._state = _State.ARGUMENTS
            return len(FENCE_OPEN)
        if FENCE_OPEN.startswith(buf):
            return None
        self._state = _State.ARGUMENTS  # no fence: the arguments follow the name directly
        return 0

    def _arguments(self, buf: str, out: ToolParse) -> int | None:
        end = buf.find(CALL_END)
        fence = buf.find(FENCE_CLOSE)
        if fence >= 0 and (end < 0 or fence < end):
            args = buf[:fence].rstrip()
            if args:
                out.calls.append(ToolCallDelta(self._index, arguments=args))
            self._state = _State.CLOSING
            return fence + len(FENCE_CLOSE)
        if end >= 0:
            args = buf[:end].rstrip()
            args = args.removesuffix("```").rstrip()
            if args:
                out.calls.append(ToolCallDelta(self._index, arguments=args))
            self._state = _State.BETWEEN
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
        self._state = _State.BETWEEN
        return end + len(CALL_END)

    def _start_call(self, name: str, out: ToolParse) -> None:
        self._index = self.num_calls
        self.num_calls += 1
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        out.calls.append(ToolCallDelta(self._index, id=call_id, name=name))


_STEPS = {
    _State.CONTENT: DeepSeekV3ToolParser._content,
    _State.BETWEEN: DeepSeekV3ToolParser._between,
    _State.HEAD: DeepSeekV3ToolParser._head,
    _State.FENCE: DeepSeekV3ToolParser._fence,
    _State.ARGUMENTS: DeepSeekV3ToolParser._arguments,
    _State.CLOSING: DeepSeekV3ToolParser._closing,
}
