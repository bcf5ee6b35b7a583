"""The files that make a folder a tokenizer folder, and the tokenizer class a folder ships as
code: one module of its own, so that the server's preflight checks them without importing
transformers (`tokenizer.py` does)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TOKENIZER_FILES", "remote_code_class"]

# A folder holding none of these has no tokenizer (e.g. a `--load-format dummy` folder of only
# config.json); transformers' own error for it speaks of sentencepiece and slow tokenizers.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def remote_code_class(folder: Path, trust_remote_code: bool) -> str | None:
    """The tokenizer class `folder` ships as Python code ("tokenization_kimi.TikTokenTokenizer",
    from tokenizer_config.json's `auto_map`: "AutoTokenizer" as [slow, fast] or one name), None
    if it names none (or the file is absent or not JSON: the tokenizer's own load reports
    that). A shipped class without `trust_remote_code` is a ValueError naming the flag."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    entry = config.get("auto_map") if isinstance(config, dict) else None
    names = entry.get("AutoTokenizer") if isinstance(entry, dict) else None
    if isinstance(names, str):
        names = [names]
    found = [n for n in names or [] if isinstance(n, str) and n]
    if not found:
        return None
    if not trust_remote_code:
        raise ValueError(
            f"tokenizer at {folder}: its class {found[0]!r} is Python code shipped with the "
            "checkpoint (tokenizer_config.json auto_map); pass --trust-remote-code "
            "(trust_remote_code=True) to run it"
        )
    return found[0]
