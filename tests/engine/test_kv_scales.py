"""Checkpoint-given FP8 KV-cache scales reach the pool, one per layer, and are applied."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.config import ModelConfig
from mlaserve.model import load_kv_scales


def with_scales(src, dst, scales: dict[int, float]):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for layer, value in scales.items():
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(value)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_scales_are_read_per_layer(checkpoint, tmp_path) -> None:
    path = with_scales(checkpoint("v3_moe"), tmp_path / "m", {1: 0.25})
    config = ModelConfig.from_pretrained(path)
    assert load_kv_scales(config, checkpoint("v3_moe")) is None
    scales = load_kv_scales(config, path)
    assert scales == [1.0, 0.25] + [1.0] * (config.num_hidden_layers - 2)


def test_engine_applies_scales_to_fp8_cache_only(checkpoint, tmp_path) -> None:
    path = with_scales(checkpoint("v3_moe"), tmp_path / "m", {0: 0.5, 1: 0.25})
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="fp8_e4m3", page_size=4)
    pool = llm.engine.runner.kv_pool
    assert pool.k_scales[:2] == [0.5, 0.25]
    exact = LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="auto", page_size=4)
    assert exact.engine.runner.kv_pool.k_scales == [1.0] * len(pool.k_scales)
    prompt, params = [[5, 6, 7, 8, 9]], SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompt, params)
    exact.generate(prompt, params)
    # The first request got page 1 in both engines. Layer 0's latent rows depend only on the
    # embeddings (identical in both runs); stored as fp8 of value / 0.5, they come back within
    # e4m3's relative step (2^-4 with round-to-nearest) once rescaled.
    want = exact.engine.runner.kv_pool.kv_buffers[0][1]
    stored = pool.kv_buffers[0][1].float()
    assert torch.allclose(stored * 0.5, want, rtol=2**-4, atol=0.5 * 2**-9)
    assert not torch.allclose(stored, want, rtol=2**-4, atol=0.5 * 2**-9)  # really scaled
