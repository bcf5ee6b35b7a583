"""The grammar of forced Kimi-K2 tool calls: what it lets through, and that the tool-call
parser reads what it lets through as the calls it means."""

from __future__ import annotations

import json

import pytest

from mlaserve.service.parsers.kimi_k2 import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_END,
    KimiK2ToolParser,
)
from mlaserve.service.parsers.kimi_k2_forced import KimiK2ForcedCall
from tests.service.parsers.forced_tools import TOOLS, grammar_accepts
from tests.service.parsers.pieces import parse_in_pieces

pytest.importorskip("xgrammar")


def _call(call_id: str, args: str) -> str:
    return f"{CALL_BEGIN}{call_id}{ARGUMENT_BEGIN}{args}{CALL_END}"


def _parse(text: str) -> tuple[str, list[dict]]:
    return parse_in_pieces(KimiK2ToolParser(), text, 10_000)


def _accepts(name: str | None, text: str, parallel: bool = True) -> bool:
    return grammar_accepts(KimiK2ForcedCall.grammar(TOOLS, name, parallel), text)


def _read(name: str | None, text: str) -> list[tuple[str, str, dict]]:
    content, calls = _parse(KimiK2ForcedCall.prefix(name) + text)
    assert content == ""
    return [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls]


def test_a_named_call_takes_valid_arguments_and_reads_back() -> None:
    text = '{"city": "Lima", "days": 2}' + CALL_END + SECTION_END
    assert _accepts("get_weather", text)
    assert not _accepts("get_weather", '{"city": "Rome"}' + CALL_END + SECTION_END)
    assert not _accepts("get_weather", '{"city": "Paris"}' + CALL_END)  # the section must end
    assert _read("get_weather", text) == [
        ("functions.get_weather:0", "get_weather", {"city": "Lima", "days": 2})
    ]


def test_required_takes_calls_of_the_tools_and_reads_back() -> None:
    one = _call("functions.get_time:0", "{}")
    two = one + _call("functions.get_weather:1", '{"city": "Paris"}')
    assert _accepts(None, one + SECTION_END) and _accepts(None, two + SECTION_END)
    assert not _accepts(None, two + SECTION_END, parallel=False)  # one call at most
    assert not _accepts(None, _call("functions.nope:0", "{}") + SECTION_END)
    assert not _accepts(None, _call("functions.get_time:0", '{"x": 1}') + SECTION_END)
    assert not _accepts(None, SECTION_END)  # at least one call
    assert _read(None, two + SECTION_END) == [
        ("functions.get_time:0", "get_time", {}),
        ("functions.get_weather:1", "get_weather", {"city": "Paris"}),
    ]
