"""The request schema's hard ceilings: what one body may hold at all (the server's own limits,
`--max-prompts-per-request` and the like, may only be lower). A module of plain numbers, so the
command line's settings check against them without importing pydantic's schema (`protocol.py`):
the engine process is spawned once the settings are built, and pydantic's import was 0.45 s of
that wait."""

from __future__ import annotations

from mlaserve.sampling_params import MAX_LOGPROBS  # top-logprobs per token (OpenAI's limit)

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_PROMPT_TOKENS",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
]

MAX_N = 16  # choices per request
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_PROMPTS = 2048
MAX_PROMPT_TOKENS = 1 << 20
