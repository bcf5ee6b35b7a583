"""How one chat request treats tools, from `tools`, `tool_choice` and the server's flags.

'none' leaves the output alone; 'auto' parses it for the calls the model writes; 'required' or
a named function forces a call: the opening of the calls is appended to the prompt and the rest
of the output is grammar-constrained to calls (parsers/deepseek_v3_forced.py,
parsers/kimi_k2_forced.py), which the same parser reads. A request the server cannot honour is a 400 naming `tool_choice`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlaserve.sampling_params import StructuredOutputsParams
from mlaserve.service.errors import BadRequestError
from mlaserve.service.parsers import FORCED_TOOL_CALLS, TOOL_PARSERS
from mlaserve.service.parsers.deepseek_r1 import THINK_END, THINK_START
from mlaserve.service.protocol import ChatCompletionRequest

__all__ = ["ToolMode"]


@dataclass(frozen=True)
class ToolMode:
    """Parse the output for calls, and for a forced call its opening and grammar."""

    parse: bool = False
    forced: str = ""  # text appended to the prompt: the opening of a call
    grammar: StructuredOutputsParams | None = None  # what the output after `forced` must follow
    finish_reason: str = "tool_calls"  # when calls were made and generation stopped normally
    # The parser's markers are special tokens (Kimi-K2): detokenize with them kept.
    keep_special_tokens: bool = False

    @classmethod
    def of(
        cls, req: ChatCompletionRequest, tool_call_parser: str | None, enable_auto: bool
    ) -> ToolMode:
        """Check tools/tool_choice against each other and the server's flags (400 otherwise)."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise BadRequestError(
                    "tool_choice: needs tools", param="tool_choice", code="invalid_value"
                )
            return cls()
        choice = choice or "auto"
        if choice == "none":
            return cls()
        parser = TOOL_PARSERS.get(tool_call_parser or "")
        if choice == "auto" and not (enable_auto and parser is not None):
            raise BadRequestError(
                "tool_choice: 'auto' (the default when tools are given) needs the server started "
                "with --enable-auto-tool-choice and --tool-call-parser",
                param="tool_choice",
                code="unsupported_parameter",
            )
        if parser is None:
            raise BadRequestError(
                "tool_choice: calling tools needs the server started with --tool-call-parser",
                param="tool_choice",
                code="unsupported_parameter",
            )
        keep = parser.keeps_special_tokens
        if choice == "auto":
            return cls(parse=True, keep_special_tokens=keep)
        name = None if choice == "required" else choice.function.name
        if name is not None and name not in {t.function.name for t in req.tools}:
            raise BadRequestError(
                f"tool_choice: function {name!r} is not among the tools",
                param="tool_choice",
                code="invalid_value",
            )
        forced = FORCED_TOOL_CALLS[tool_call_parser or ""]
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        tag = forced.grammar(tools, name, parallel=req.parallel_tool_calls is not False)
        return cls(
            parse=True,
            forced=forced.prefix(name),
            grammar=StructuredOutputsParams(structural_tag=tag),
            # OpenAI (and vLLM) end a call the client forced by name with "stop".
            finish_reason="tool_calls" if name is None else "stop",
            keep_special_tokens=keep,
        )

    def continuation(self, reasoning: bool) -> Callable[[str], str] | None:
        """What `render_chat` appends to the rendered prompt (None: nothing); `reasoning`: the
        server runs a reasoning parser."""
        if not self.forced:
            return None
        forced = self.forced

        def append(prompt: str) -> str:
            # R1's template opens the reasoning in the prompt; a forced call closes it first.
            still_open = prompt.rfind(THINK_START) > prompt.rfind(THINK_END)
            return (THINK_END + "\n\n" if reasoning and still_open else "") + forced

        return append
