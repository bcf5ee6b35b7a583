"""Text side of the server: the HF tokenizer wrapper, incremental detokenization for streaming,
and stop-string matching.

The names are imported on first use (PEP 562): `tokenizer.py` imports transformers, which a
process that only needs `tokenizer_files` (the server's preflight) should not wait for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlaserve.tokenizer.detokenizer import IncrementalDetokenizer
    from mlaserve.tokenizer.stop import find_stop, stop_holdback
    from mlaserve.tokenizer.tokenizer import ChatTemplateError, Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "find_stop", "stop_holdback"]

_HOMES = {
    "ChatTemplateError": "tokenizer",
    "Tokenizer": "tokenizer",
    "IncrementalDetokenizer": "detokenizer",
    "find_stop": "stop",
    "stop_holdback": "stop",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
