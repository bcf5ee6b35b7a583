"""DeepSeek-V3 tool calls: the same answer however the text is cut into pieces."""

from __future__ import annotations

import json

import pytest

from mlaserve.service.parsers.deepseek_v3 import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    DeepSeekV3ToolParser,
)
from mlaserve.service.parsers.deepseek_v3_forced import DeepSeekV3ForcedCall
from tests.service.parsers.pieces import parse_in_pieces


def _call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


TWO_CALLS = (
    "Let me look.\n" + CALLS_BEGIN + _call("get_weather", '{"city": "Paris"}') + "\n"
    + _call("get_time", '{"tz": "UTC", "note": "a\\n```b"}') + CALLS_END
)  # fmt: skip


def _parse(text: str, step: int) -> tuple[str, list[dict]]:
    content, calls = parse_in_pieces(DeepSeekV3ToolParser(), text, step)
    assert all(c.pop("id").startswith("call_") for c in calls)
    return content, calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 10_000])
def test_calls_are_the_same_in_any_pieces(step: int) -> None:
    content, calls = _parse(TWO_CALLS, step)
    assert content == "Let me look.\n"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["arguments"]) == {"tz": "UTC", "note": "a\n```b"}


def test_text_without_calls_is_content_even_where_it_looks_like_a_marker() -> None:
    text = "a <｜tool▁ fence ``` and <｜tool▁call"
    assert _parse(text, 1) == (text, [])


def test_a_call_cut_short_keeps_what_was_written() -> None:
    text = CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}get_weather\n```json\n" + '{"city": "Pa'
    content, calls = _parse(text, 1)
    assert content == "" and calls == [{"name": "get_weather", "arguments": '{"city": "Pa'}]


@pytest.mark.parametrize(
    "cut", ["\n", "\n``", "\n```", "\n```" + CALL_END[:5], "\n```" + CALL_END[:5] + "\ufffd"]
)
def test_a_call_cut_short_in_its_closing_keeps_whole_arguments(cut: str) -> None:
    text = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{{}}{cut}"
    assert _parse(text, 1) == ("", [{"name": "get_time", "arguments": "{}"}])
    assert _parse(text, len(text)) == ("", [{"name": "get_time", "arguments": "{}"}])


def test_a_call_cut_short_after_its_separator_is_no_call() -> None:
    text = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}"
    assert _parse(text, 1) == ("", []) and _parse(text, len(text)) == ("", [])


def test_a_forced_opening_starts_inside_the_call() -> None:
    parser = DeepSeekV3ToolParser()
    first = parser.feed(DeepSeekV3ForcedCall.prefix("get_weather"))
    assert [(c.index, c.name) for c in first.calls] == [(0, "get_weather")]
    rest = parser.feed('{"city": "Paris"}\n```' + CALL_END + CALLS_END)
    assert rest.content == "" and "".join(c.arguments for c in rest.calls) == '{"city": "Paris"}'
