"""Test helper: a tool-call parser fed the text in pieces of `step` characters."""

from __future__ import annotations

from mlaserve.service.parsers.tool_parse import ToolParse, ToolParser


def parse_in_pieces(parser: ToolParser, text: str, step: int) -> tuple[str, list[dict]]:
    """(content, calls [{"id", "name", "arguments"}] in index order) of `text` fed in pieces
    and finished; checks that each call's first piece (and only it) carries the id, and that
    the indexes run 0, 1, ..."""
    out = ToolParse()
    for i in range(0, len(text), step):
        out.extend(parser.feed(text[i : i + step]))
    out.extend(parser.finish())
    calls: dict[int, dict] = {}
    for piece in out.calls:
        if piece.id is not None:
            assert piece.index not in calls
            calls[piece.index] = {"id": piece.id, "name": piece.name, "arguments": ""}
        calls[piece.index]["arguments"] += piece.arguments
    assert sorted(calls) == list(range(len(calls)))
    return out.content, [calls[i] for i in sorted(calls)]
