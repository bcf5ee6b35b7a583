"""The shipped default model through mlaserve equals transformers token for token (fp32, CPU),
on prefixes of files the model never trained on (the held-out split shipped in tools/data)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from mlaserve import LLM, SamplingParams
from mlaserve.config import default_model_path
from tests.engine.greedy_oracle import hf_greedy

HELDOUT = Path(__file__).resolve().parents[1] / "tools" / "data" / "default_model_heldout.jsonl.gz"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prefixes() -> list[str]:
    with gzip.open(HELDOUT, "rt") as f:
        files = [json.loads(line) for line in f]
    # The first 300 characters of three held-out files: real, unseen code.
    return [files[i]["text"][:300] for i in (0, 4, 7)]


def test_default_model_greedy_equals_transformers(prefixes: list[str]) -> None:
    llm = LLM(device="cpu", dtype="float32", kv_cache_dtype="auto")  # no model: the default
    reference = DeepseekV3ForCausalLM.from_pretrained(
        default_model_path(), dtype=torch.float32
    ).eval()
    prompts = [llm.tokenizer.encode(p) for p in prefixes]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(reference, prompt, NEW_TOKENS)
    text = llm.generate(["def fibonacci(n):"], params)[0].outputs[0].text
    assert any(kw in text for kw in ("return", "if ", "def ", "for ")), text
