"""Prompts and the transformers greedy oracle of the engine parity tests: greedy decoding with
transformers' own model in fp32, re-running the full sequence each step (no cache), so nothing
about paging or batching can leak into it."""

from __future__ import annotations

import random

import torch

from mlaserve import SamplingParams

NEW_TOKENS = 32
PROMPT_LENS = [1, 3, 7, 12, 20, 33, 5, 48]


def prompts_for(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENS]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        token = int(model(ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def token_ids(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]
