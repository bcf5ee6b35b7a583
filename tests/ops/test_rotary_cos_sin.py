"""The fused rotary cos / sin vs `RotaryEmbedding`'s torch reference: bit for bit on the GPU
(the same fp32 products, CUDA's cosf / sinf on both sides), within 2 fp32 ulps under the
interpreter (numpy's cos there). Positions up to V3's 163840 context, V3's YaRN frequencies
and V2-Lite's, at decode, VERIFY and prefill token counts."""

from __future__ import annotations

import pytest
import torch

from mlaserve.config import ModelConfig
from mlaserve.model.layers.rotary import rope_inv_freq
from tests.ops.cases import cpu_case, gpu_case

# V3's rope_scaling (config.json), and plain RoPE (V2-Lite's factor-free layout)
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
CONFIG = {"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
          "qk_nope_head_dim": 128, "rope_theta": 10000}  # fmt: skip
CASES = [gpu_case(t, yarn) for t in (1, 8, 19, 300, 4096) for yarn in (True, False)]
CASES += [cpu_case(21, True)]


def _reference(positions, inv_freq, factor):
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos() * factor, freqs.sin() * factor


@pytest.mark.parametrize("num_tokens,yarn,device", CASES)
def test_rotary_cos_sin_matches_reference(num_tokens, yarn, device):
    from mlaserve.ops.rotary_cos_sin import rotary_cos_sin

    config = ModelConfig.from_dict({**CONFIG, **({"rope_scaling": YARN} if yarn else {})})
    inv_freq, factor = rope_inv_freq(config)
    inv_freq = inv_freq.to(device)
    g = torch.Generator(device=device).manual_seed(num_tokens)
    positions = torch.randint(0, 163840, (num_tokens,), generator=g, device=device)
    positions[0] = 163839
    cos, sin = rotary_cos_sin(positions, inv_freq, factor)
    want_cos, want_sin = _reference(positions, inv_freq, factor)
    assert cos.shape == sin.shape == (num_tokens, 32) and cos.dtype == torch.float32
    if device == "cuda":
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    else:
        ulp = 2 * torch.finfo(torch.float32).eps * max(factor, 1.0)
        torch.testing.assert_close(cos, want_cos, rtol=0, atol=ulp)
        torch.testing.assert_close(sin, want_sin, rtol=0, atol=ulp)


def test_rotary_cos_sin_refuses_what_it_cannot_read() -> None:
    from mlaserve.ops.rotary_cos_sin import rotary_cos_sin

    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="int64"):
        rotary_cos_sin(torch.zeros(3, dtype=torch.int32), torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match="fp32"):
        rotary_cos_sin(torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.float64), 1.0)
