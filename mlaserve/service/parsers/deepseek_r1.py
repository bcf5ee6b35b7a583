"""DeepSeek-R1's reasoning: `<think>...</think>` in the output becomes `reasoning_content`.

R1's chat template ends the generation prompt with `<think>\\n`, so the output usually starts
inside the reasoning and only `</think>` shows; an output that does open with `<think>` has it
removed. Everything before `</think>` is reasoning, everything after it is content; an output
with no `</think>` (cut by max_tokens while thinking) is all reasoning. vLLM's and SGLang's
deepseek_r1 parsers split it the same way.

Streaming: `feed` takes each new piece of text and returns the (reasoning, content) it can
already tell apart; a trailing piece that could be the start of `</think>` waits for the next
call, so a marker split over two pieces never leaks into either field. `finish` releases it.
"""

from __future__ import annotations

from mlaserve.service.parsers.markers import partial_marker_len

__all__ = ["DeepSeekR1ReasoningParser"]

THINK_START = "<think>"
THINK_END = "</think>"


class DeepSeekR1ReasoningParser:
    """The state of one choice's output; one instance per choice."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet classified
        self._at_start = True  # an opening <think> may still come
        self._thinking = True

    @property
    def thinking(self) -> bool:
        """Whether the output is still inside the reasoning."""
        return self._thinking

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of `text`, as far as it can be told yet."""
        if not self._thinking:
            return "", text
        buf = self._pending + text
        if self._at_start:
            stripped = buf.lstrip()
            if THINK_START.startswith(stripped) and len(stripped) < len(THINK_START):
                self._pending = buf  # maybe the start of "<think>": wait
                return "", ""
            self._at_start = False
            if stripped.startswith(THINK_START):
                buf = stripped[len(THINK_START) :]
        end = buf.find(THINK_END)
        if end >= 0:
            self._thinking = False
            self._pending = ""
            return buf[:end], buf[end + len(THINK_END) :]
        held = partial_marker_len(buf, THINK_END)
        self._pending = buf[len(buf) - held :]
        return buf[: len(buf) - held], ""

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output: reasoning cut short."""
        pending, self._pending = self._pending, ""
        return (pending, "") if self._thinking else ("", pending)
