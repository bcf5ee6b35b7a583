"""The grammar of a forced DeepSeek-V3 tool call (tool_choice 'required' or a named function).

Choice: the output stays in DeepSeek-V3's own tool-call format (the markers its template and
`DeepSeekV3ToolParser` use), not vLLM's JSON array of {name, parameters}: the model writes what
it was trained to write, and the parser that reads 'auto' calls reads forced ones too, streamed
and not. What xgrammar constrains is what comes after the opening forced into the prompt
(`DeepSeekV3ForcedCall.prefix`):

- named: the arguments (JSON valid against the tool's `parameters`), then the closing markers;
- required: one call or more (one with parallel_tool_calls=false), each naming one of the tools
  and its arguments valid against that tool's schema, then the closing marker.

The grammar is an xgrammar structural tag, written here as plain JSON so the service does not
import xgrammar (the engine compiles it, or refuses the request when xgrammar is missing).
"""

from __future__ import annotations

import json
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

__all__ = ["DeepSeekV3ForcedCall"]

# vLLM's schema for a tool without `parameters`: an object with no properties, i.e. `{}`
# (xgrammar refuses properties a schema does not list).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# One whitespace character at most between JSON tokens: the model's usual `{"a": 1}` fits, and
# a weak model cannot pad the arguments forever.
_MAX_WHITESPACE = 1


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
        schemas = {t["function"]["name"]: _parameters(t["function"]) for t in tools}
        if name is not None:
            fmt = _sequence(
                _arguments(schemas[name]), _const(f"{FENCE_CLOSE}{CALL_END}{CALLS_END}")
            )
        else:
            tags = [
                {
                    "type": "tag",
                    "begin": _call_head(tool),
                    "content": _arguments(schema),
                    "end": f"{FENCE_CLOSE}{CALL_END}",
                }
                for tool, schema in schemas.items()
            ]
            calls = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "\n",  # DeepSeek-V3's template joins calls with a newline
                "at_least_one": True,
                "stop_after_first": not parallel,
            }
            fmt = _sequence(calls, _const(CALLS_END))
        return json.dumps({"type": "structural_tag", "format": fmt})


def _call_head(name: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n{FENCE_OPEN}"


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if params else NO_PARAMETERS


def _arguments(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": _MAX_WHITESPACE}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}
