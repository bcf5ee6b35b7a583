"""Parsers of what a model writes into OpenAI's structured chat fields, by vLLM's names:
`--tool-call-parser deepseek_v3` (tool calls) and `--reasoning-parser deepseek_r1`."""

from mlaserve.service.parsers.chat_output import ChatOutputParser, ChatParts
from mlaserve.service.parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from mlaserve.service.parsers.deepseek_v3 import DeepSeekV3ToolParser, ToolCallDelta
from mlaserve.service.parsers.deepseek_v3_forced import DeepSeekV3ForcedCall

__all__ = [
    "FORCED_TOOL_CALLS",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChatOutputParser",
    "ChatParts",
    "DeepSeekR1ReasoningParser",
    "DeepSeekV3ForcedCall",
    "DeepSeekV3ToolParser",
    "ToolCallDelta",
]

TOOL_PARSERS = {"deepseek_v3": DeepSeekV3ToolParser}
# Per tool-call parser: the opening and the grammar of a call tool_choice forces.
FORCED_TOOL_CALLS = {"deepseek_v3": DeepSeekV3ForcedCall}
REASONING_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser}
