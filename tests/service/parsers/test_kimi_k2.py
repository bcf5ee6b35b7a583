"""Kimi-K2 tool calls: the same answer however the text is cut into pieces; ids as the model
wrote them."""

from __future__ import annotations

import json

import pytest

from mlaserve.service.parsers.kimi_k2 import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    KimiK2ToolParser,
    call_name,
)
from tests.service.parsers.pieces import parse_in_pieces


def _call(call_id: str, args: str, space: str = "") -> str:
    return f"{CALL_BEGIN}{call_id}{ARGUMENT_BEGIN}{space}{args}{space}{CALL_END}"


TWO_CALLS = (
    "Let me look.\n" + SECTION_BEGIN + "\n" + _call("functions.get_weather:0", '{"city": "Paris"}')
    + "\n" + _call("functions.get_time:1", '{"tz": "UTC",\n "note": "a <|tool b"}', " \n")
    + "\n" + SECTION_END
)  # fmt: skip


def _parse(text: str, step: int) -> tuple[str, list[dict]]:
    return parse_in_pieces(KimiK2ToolParser(), text, step)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 10_000])
def test_calls_are_the_same_in_any_pieces(step: int) -> None:
    content, calls = _parse(TWO_CALLS, step)
    assert content == "Let me look.\n"
    assert [(c["id"], c["name"]) for c in calls] == [
        ("functions.get_weather:0", "get_weather"), ("functions.get_time:1", "get_time"),
    ]  # fmt: skip
    assert calls[0]["arguments"] == '{"city": "Paris"}'  # as written, outer space trimmed
    assert json.loads(calls[1]["arguments"]) == {"tz": "UTC", "note": "a <|tool b"}
    assert calls[1]["arguments"].startswith("{") and calls[1]["arguments"].endswith("}")


def test_text_without_calls_is_content_even_where_it_looks_like_a_marker() -> None:
    text = "a <|tool_calls_sect and <|tool_call"
    assert _parse(text, 1) == (text, [])


def test_a_call_cut_short_keeps_what_was_written_and_a_cut_id_is_no_call() -> None:
    text = SECTION_BEGIN + _call("functions.f:0", '{"a": 1}') + CALL_BEGIN + "functions.g:1"
    _, calls = _parse(text + ARGUMENT_BEGIN + ' {"b": [1, ', 1)
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"a": 1}'), ("g", '{"b": [1,')]
    _, calls = _parse(text, 1)  # the second id never finished: one call
    assert [c["name"] for c in calls] == ["f"]


def test_a_call_without_arguments_and_odd_ids() -> None:
    _, calls = _parse(SECTION_BEGIN + CALL_BEGIN + "functions.ping:0" + CALL_END + SECTION_END, 1)
    assert [(c["name"], c["arguments"]) for c in calls] == [("ping", "")]
    assert call_name("functions.a.b:12") == "a.b" and call_name("plain") == "plain"


def test_content_after_the_section_is_content() -> None:
    text = SECTION_BEGIN + _call("functions.f:0", "{}") + SECTION_END + " done"
    content, calls = _parse(text, 2)
    assert content == " done" and [c["arguments"] for c in calls] == ["{}"]
