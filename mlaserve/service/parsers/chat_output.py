"""One choice's generated text, split into reasoning, content and tool calls as it arrives.

The reasoning parser sees the text first; what it calls content goes on to the tool parser.
A named (or required) tool_choice forces the opening of a call into the prompt: the parser is
then told that text first (`forced`), so it starts inside the call and emits the name at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlaserve.service.parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from mlaserve.service.parsers.tool_parse import ToolCallDelta, ToolParse, ToolParser

__all__ = ["ChatOutputParser", "ChatParts"]


@dataclass(slots=True)
class ChatParts:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChatOutputParser:
    def __init__(
        self,
        reasoning: DeepSeekR1ReasoningParser | None,
        tools: ToolParser | None,
        forced: str = "",
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls
        self._forced = ChatParts()
        if tools is not None and forced:
            self._forced = self._from_tools(tools.feed(forced))

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def feed(self, text: str) -> ChatParts:
        parts, self._forced = self._forced, ChatParts()
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            parts.reasoning += reasoning
        self._add(parts, text, finish=False)
        return parts

    def finish(self) -> ChatParts:
        parts, self._forced = self._forced, ChatParts()
        text = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.finish()
            parts.reasoning += reasoning
        self._add(parts, text, finish=True)
        return parts

    def _add(self, parts: ChatParts, text: str, finish: bool) -> None:
        if self.tools is None:
            parts.content += text
            return
        parsed = self.tools.feed(text) if text else ToolParse()
        if finish:
            parsed.extend(self.tools.finish())
        more = self._from_tools(parsed)
        parts.content += more.content
        parts.calls.extend(more.calls)

    def _from_tools(self, parsed: ToolParse) -> ChatParts:
        calls = parsed.calls
        if not self.parallel_tool_calls:  # the client asked for one call at most
            calls = [c for c in calls if c.index == 0]
        return ChatParts(content=parsed.content, calls=calls)
