"""Parsers of what a model writes into OpenAI's structured chat fields, by vLLM's names:
`--tool-call-parser deepseek_v3` / `kimi_k2` (tool calls) and `--reasoning-parser deepseek_r1`."""

from mlaserve.service.parsers.chat_output import ChatOutputParser, ChatParts
from mlaserve.service.parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from mlaserve.service.parsers.deepseek_v3 import DeepSeekV3ToolParser
from mlaserve.service.parsers.deepseek_v3_forced import DeepSeekV3ForcedCall
from mlaserve.service.parsers.kimi_k2 import KimiK2ToolParser
from mlaserve.service.parsers.kimi_k2_forced import KimiK2ForcedCall
from mlaserve.service.parsers.tool_parse import ToolCallDelta, ToolParser

__all__ = [
    "FORCED_TOOL_CALLS",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChatOutputParser",
    "ChatParts",
    "DeepSeekR1ReasoningParser",
    "DeepSeekV3ForcedCall",
    "DeepSeekV3ToolParser",
    "KimiK2ForcedCall",
    "KimiK2ToolParser",
    "ToolCallDelta",
    "ToolParser",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "kimi_k2": KimiK2ToolParser,
}
# Per tool-call parser: the opening and the grammar of a call tool_choice forces.
FORCED_TOOL_CALLS = {"deepseek_v3": DeepSeekV3ForcedCall, "kimi_k2": KimiK2ForcedCall}
REASONING_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser}
