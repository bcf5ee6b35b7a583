"""The grammar of a forced Kimi-K2 tool call (tool_choice 'required' or a named function).

As for DeepSeek-V3 (`deepseek_v3_forced.py`), the output stays in the model's own format, read
by `KimiK2ToolParser`, and what xgrammar constrains is what follows the opening forced into the
prompt (`KimiK2ForcedCall.prefix`):

- named: the arguments (JSON valid against the tool's `parameters`), then the closing markers;
  its id is `functions.NAME:0`, the first call of the turn;
- required: one call or more (one with parallel_tool_calls=false), each `functions.NAME:INDEX`
  for one of the tools (INDEX the model's: digits) and its arguments valid against that tool's
  schema, then the section's end.
"""

from __future__ import annotations

from typing import Any

from mlaserve.service.parsers.kimi_k2 import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    FUNCTIONS,
    SECTION_BEGIN,
    SECTION_END,
)
from mlaserve.service.parsers.structural_tag import (
    arguments,
    const,
    forced_calls,
    parameters,
    regex,
    sequence,
    structural_tag,
    tag,
)

__all__ = ["KimiK2ForcedCall"]


class KimiK2ForcedCall:
    """What `tool_choice` 'required' or named forces: the prompt's continuation and the grammar
    of the rest."""

    @staticmethod
    def prefix(name: str | None) -> str:
        """The section's opening, and for a named tool its call's opening up to the arguments."""
        if name is None:
            return SECTION_BEGIN
        return f"{SECTION_BEGIN}{CALL_BEGIN}{FUNCTIONS}{name}:0{ARGUMENT_BEGIN}"

    @staticmethod
    def grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
        """The structural tag (JSON text) the output must follow after `prefix(name)`."""
        schemas = {t["function"]["name"]: parameters(t["function"]) for t in tools}
        if name is not None:
            return structural_tag(
                sequence(arguments(schemas[name]), const(f"{CALL_END}{SECTION_END}"))
            )
        index = regex("[0-9]{1,3}")
        tags = [
            tag(
                f"{CALL_BEGIN}{FUNCTIONS}{tool}:",
                sequence(index, const(ARGUMENT_BEGIN), arguments(schema)),
                CALL_END,
            )
            for tool, schema in schemas.items()
        ]
        # Kimi's calls follow one another directly.
        return structural_tag(sequence(forced_calls(tags, "", parallel), const(SECTION_END)))
