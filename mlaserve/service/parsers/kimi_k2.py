"""Kimi-K2's tool calls, read from the model's own marker tokens.

Kimi-K2 writes a turn with tool calls as (whitespace may stand between the markers):

    [content]<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX
    <|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>[more calls]<|tool_calls_section_end|>

each marker one special token of its tokenizer, so the request is detokenized with special
tokens kept (`keeps_special_tokens`, as vLLM's `kimi_k2` parser asks). `functions.NAME:INDEX` is
the call's id as the model wrote it, and Kimi's chat template quotes it back when the client
returns the result, so it is kept as the OpenAI `id` (as vLLM does); NAME is what stands between
`functions.` and the last `:`. ARGUMENTS (a JSON object) pass through as written, outer
whitespace trimmed, so the streamed pieces add up to exactly the non-streamed `arguments`.
Trailing whitespace of the arguments is held until the next `feed` tells whether the end marker
follows.
"""

from __future__ import annotations

from mlaserve.service.parsers.markers import partial_marker_len
from mlaserve.service.parsers.sectioned_calls import SectionedCallsParser
from mlaserve.service.parsers.tool_parse import ToolCallDelta, ToolParse

__all__ = ["KimiK2ToolParser", "call_name"]

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
FUNCTIONS = "functions."


def call_name(call_id: str) -> str:
    """NAME of `functions.NAME:INDEX` (the id itself, less what is absent)."""
    name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    return name.removeprefix(FUNCTIONS)


class KimiK2ToolParser(SectionedCallsParser):
    """The state of one choice's output; one instance per choice (`tool_parse.ToolParser`).
    States past `sectioned_calls.py`'s: head (the id, up to <|tool_call_argument_begin|>),
    arguments (the JSON, up to <|tool_call_end|>)."""

    SECTION_BEGIN = SECTION_BEGIN
    SECTION_END = SECTION_END
    CALL_BEGIN = CALL_BEGIN
    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._started = False  # the current call's arguments have begun (leading space gone)

    def _finish_call(self, pending: str, out: ToolParse) -> None:
        """A call cut short keeps its text; a call whose id was cut short is no call."""
        if self._state == "arguments":
            args = pending[: len(pending) - partial_marker_len(pending, CALL_END)].rstrip()
            if not self._started:
                args = args.lstrip()
            if args:
                out.calls.append(ToolCallDelta(self._index, arguments=args))

    # ----- one step per state: consume a prefix of `buf` (its length) or wait (None) -----
    def _head(self, buf: str, out: ToolParse) -> int | None:
        begin, end = buf.find(ARGUMENT_BEGIN), buf.find(CALL_END)
        if end >= 0 and (begin < 0 or end < begin):  # a call without arguments
            self._start_kimi_call(buf[:end].strip(), out)
            self._state = "between"
            return end + len(CALL_END)
        if begin < 0:
            return None
        self._start_kimi_call(buf[:begin].strip(), out)
        self._state, self._started = "arguments", False
        return begin + len(ARGUMENT_BEGIN)

    def _arguments(self, buf: str, out: ToolParse) -> int | None:
        if not self._started:
            rest = buf.lstrip()
            if not rest:
                return None if not buf else len(buf)
            self._started = True
            return len(buf) - len(rest)
        end = buf.find(CALL_END)
        if end >= 0:
            args = buf[:end].rstrip()
            if args:
                out.calls.append(ToolCallDelta(self._index, arguments=args))
            self._state = "between"
            return end + len(CALL_END)
        body = buf[: len(buf) - partial_marker_len(buf, CALL_END)]
        ready = len(body.rstrip())  # trailing whitespace: maybe the last before the end marker
        if ready <= 0:
            return None
        out.calls.append(ToolCallDelta(self._index, arguments=buf[:ready]))
        return ready

    def _start_kimi_call(self, call_id: str, out: ToolParse) -> None:
        self._start_call(call_name(call_id), out, call_id=call_id or None)
