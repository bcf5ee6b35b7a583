"""DeepSeek-R1 reasoning: `</think>` splits reasoning from content, in any pieces."""

from __future__ import annotations

import pytest

from mlaserve.service.parsers.deepseek_r1 import DeepSeekR1ReasoningParser


def _split(text: str, step: int) -> tuple[str, str]:
    parser, reasoning, content = DeepSeekR1ReasoningParser(), "", ""
    for i in range(0, len(text), step):
        r, c = parser.feed(text[i : i + step])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("step", [1, 2, 5, 10_000])
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("plan it</think>\n\nThe answer.", ("plan it", "\n\nThe answer.")),
        ("<think>plan it</think>done", ("plan it", "done")),  # an opening <think> is dropped
        ("still thinking when cut <", ("still thinking when cut <", "")),  # no </think>
        ("a < b </thin k></think>x</think>", ("a < b </thin k>", "x</think>")),
    ],
)
def test_reasoning_and_content_in_any_pieces(step: int, text: str, expected) -> None:
    assert _split(text, step) == expected
