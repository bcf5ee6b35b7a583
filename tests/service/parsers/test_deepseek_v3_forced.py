"""The grammar of forced DeepSeek-V3 tool calls: what it lets through, and that the tool-call
parser reads what it lets through as the calls it means."""

from __future__ import annotations

import json

import pytest

from mlaserve.service.parsers.deepseek_v3 import (
    CALL_BEGIN,
    CALL_END,
    CALLS_END,
    SEP,
    DeepSeekV3ToolParser,
)
from mlaserve.service.parsers.deepseek_v3_forced import DeepSeekV3ForcedCall
from tests.service.parsers.forced_tools import TOOLS, grammar_accepts

pytest.importorskip("xgrammar")


def _accepts(name: str | None, text: str, parallel: bool = True) -> bool:
    return grammar_accepts(DeepSeekV3ForcedCall.grammar(TOOLS, name, parallel), text)


def _call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def _read(name: str | None, text: str) -> list[tuple[str, dict]]:
    parser = DeepSeekV3ToolParser()
    pieces = parser.feed(DeepSeekV3ForcedCall.prefix(name) + text).calls
    pieces += parser.finish().calls
    names = {p.index: p.name for p in pieces if p.name is not None}
    args = {i: "".join(p.arguments for p in pieces if p.index == i) for i in names}
    return [(names[i], json.loads(args[i])) for i in sorted(names)]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('{"city": "Paris"}', True),
        ('{"city":"Lima","days":3}', True),
        ('{"city": "Rome"}', False),  # not in the enum
        ('{"days": 3}', False),  # city is required
        ('{"city": "Paris", "x": 1}', False),  # a property the schema does not list
        ('{"city":  "Paris"}', False),  # two spaces: whitespace is bounded
    ],
)
def test_named_call_arguments_follow_the_schema(text: str, ok: bool) -> None:
    assert _accepts("get_weather", f"{text}\n```{CALL_END}{CALLS_END}") is ok
    assert not _accepts("get_weather", text)  # the call's closing is part of it


def test_named_call_is_read_as_that_call() -> None:
    text = f'{{"city": "Lima"}}\n```{CALL_END}{CALLS_END}'
    assert _read("get_weather", text) == [("get_weather", {"city": "Lima"})]


def test_a_tool_without_parameters_takes_an_empty_object() -> None:
    assert _accepts("get_time", f"{{}}\n```{CALL_END}{CALLS_END}")
    assert not _accepts("get_time", f'{{"tz": "UTC"}}\n```{CALL_END}{CALLS_END}')


def test_required_calls_name_a_given_tool() -> None:
    weather, time = _call("get_weather", '{"city": "Paris"}'), _call("get_time", "{}")
    assert _accepts(None, weather + CALLS_END) and _accepts(None, time + CALLS_END)
    assert not _accepts(None, _call("get_news", "{}") + CALLS_END)
    assert not _accepts(None, _call("", "{}") + CALLS_END)
    assert not _accepts(None, CALLS_END)  # at least one call
    assert not _accepts(None, _call("get_weather", '{"city": "Oslo"}') + CALLS_END)
    two = weather + "\n" + time + CALLS_END
    assert _accepts(None, two) and not _accepts(None, two, parallel=False)
    assert _read(None, two) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
