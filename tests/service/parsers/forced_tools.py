"""Test helper: the tools the forced-call grammar tests use, and whether a grammar accepts a
text (xgrammar, imported by the caller's `pytest.importorskip`)."""

from __future__ import annotations

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Lima"]}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: `{}` only
]


def grammar_accepts(structural_tag: str, text: str) -> bool:
    """Whether the structural tag (JSON text) accepts exactly `text`."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(structural_tag), text)
