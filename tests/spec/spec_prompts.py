"""Prompts of the speculative-decoding tests, and the token ids of their results."""

from __future__ import annotations

import random

PROMPT_LENS = [1, 3, 7, 12, 20, 33, 5, 48]


def prompts_for(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def token_ids(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]
