"""The grammar of a forced DeepSeek-V3 tool call (tool_choice 'required' or a named function).

Choice: the output stays in DeepSeek-V3's own tool-call format (the markers its template and
`DeepSeekV3ToolParser` use), not vLLM's JSON array of {name, parameters}: the model writes what
it was trained to write, and the parser that reads 'auto' calls reads forced ones too, streamed
and not. What xgrammar constrains is what comes after the opening forced into the prompt
(`DeepSeekV3ForcedCall.prefix`):

- named: the arguments (JSON valid against the tool's `parameters`), then the closing markers;
- required: one call or more (one with parallel_tool_calls=false), each naming one of the tools
  and its arguments valid against that tool's schema, then the closing marker.

The grammar is an xgrammar structural tag (`structural_tag.py`).
"""

from __future__ import annotations

from typing import Any

from mlaserve.service.parsers.deepseek_v3 import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    FENCE_CLOSE,
    FENCE_OPEN,
    SEP,
)
from mlaserve.service.parsers.structural_tag import (
    arguments,
    const,
    forced_calls,
    parameters,
    sequence,
    structural_tag,
    tag,
)

__all__ = ["DeepSeekV3ForcedCall"]


class DeepSeekV3ForcedCall:
    """What `tool_choice` 'required' or named forces: the prompt's continuation and the grammar
    of the rest."""

    @staticmethod
    def prefix(name: str | None) -> str:
        """The text forced after the prompt: the calls' opening, and for a named tool the
        opening of its call up to the arguments."""
        return CALLS_BEGIN if name is None else f"{CALLS_BEGIN}{_call_head(name)}"

    @staticmethod
    def grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
        """The structural tag (JSON text) the output must follow after `prefix(name)`. `tools`
        are OpenAI tool dicts ({"type": "function", "function": {...}})."""
        schemas = {t["function"]["name"]: parameters(t["function"]) for t in tools}
        if name is not None:
            return structural_tag(
                sequence(arguments(schemas[name]), const(f"{FENCE_CLOSE}{CALL_END}{CALLS_END}"))
            )
        tags = [
            tag(_call_head(tool), arguments(schema), f"{FENCE_CLOSE}{CALL_END}")
            for tool, schema in schemas.items()
        ]
        # DeepSeek-V3's template joins calls with a newline.
        return structural_tag(sequence(forced_calls(tags, "\n", parallel), const(CALLS_END)))


def _call_head(name: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n{FENCE_OPEN}"
