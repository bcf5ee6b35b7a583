"""Pieces of xgrammar structural tags, written as plain JSON-ready dicts so the service does not
import xgrammar (the engine compiles the tag, or refuses the request when xgrammar is missing).
The forced tool calls of every tool-call format are built from them."""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "NO_PARAMETERS",
    "arguments",
    "const",
    "forced_calls",
    "parameters",
    "regex",
    "sequence",
    "structural_tag",
    "tag",
]

# vLLM's schema for a tool without `parameters`: an object with no properties, i.e. `{}`
# (xgrammar refuses properties a schema does not list).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# One whitespace character at most between JSON tokens: the model's usual `{"a": 1}` fits, and
# a weak model cannot pad the arguments forever.
MAX_WHITESPACE = 1


def parameters(function: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function's `parameters` schema, `{}` where it has none."""
    params = function.get("parameters")
    return params if params else NO_PARAMETERS


def arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """JSON valid against `schema`, with bounded whitespace."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}


def const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def regex(pattern: str) -> dict[str, Any]:
    return {"type": "regex", "pattern": pattern}


def sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def forced_calls(tags: list[dict[str, Any]], separator: str, parallel: bool) -> dict[str, Any]:
    """One call or more, each one of `tags`, joined by `separator`; one only unless `parallel`
    (tool_choice 'required' with parallel_tool_calls)."""
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


def structural_tag(fmt: dict[str, Any]) -> str:
    """The JSON text of a structural tag whose format is `fmt`."""
    return json.dumps({"type": "structural_tag", "format": fmt})
