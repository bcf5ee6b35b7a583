"""RoPE / YaRN parameters at the published models' sizes vs transformers' own computation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mlaserve.config import ModelConfig
from mlaserve.model.layers.rotary import apply_rope, rope_inv_freq

_V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
_V2_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    "v3_671b": {"model_type": "deepseek_v3", "rope_scaling": _V3_YARN, "rope_theta": 10000,
                "max_position_embeddings": 163840},
    "v2_236b": {"model_type": "deepseek_v2", "rope_scaling": _V2_YARN, "rope_theta": 10000,
                "max_position_embeddings": 163840},
    "unequal_mscales": {"model_type": "deepseek_v3", "rope_theta": 50000,
                        "rope_scaling": {**_V3_YARN, "factor": 8, "mscale": 0.9,
                                         "mscale_all_dim": 0.5}},
    "plain": {"model_type": "deepseek_v3", "rope_theta": 10000},
}  # fmt: skip


def _both(name: str) -> tuple[ModelConfig, Any]:
    from transformers import DeepseekV2Config, DeepseekV3Config

    d = {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, **CONFIGS[name]}  # fmt: skip
    ours = ModelConfig.from_dict(d)
    cls = DeepseekV3Config if d["model_type"] == "deepseek_v3" else DeepseekV2Config
    theirs = cls(**{k: v for k, v in d.items() if k != "model_type"})
    return ours, theirs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inv_freq_and_scales_match_transformers(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    ours, theirs = _both(name)
    inv_freq, attention_factor = rope_inv_freq(ours)
    if ours.rope_scaling is None:
        ref_inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
        ref_factor = 1.0
    else:
        ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=0, atol=0)
    assert attention_factor == pytest.approx(ref_factor, rel=1e-12)
    ref_softmax_scale = yarn_apply_mscale(theirs.rope_parameters, ours.qk_head_dim**-0.5)
    assert ours.softmax_scale == pytest.approx(ref_softmax_scale, rel=1e-12)


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rope_matches_transformers(interleaved: bool) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 3, 8, generator=g), torch.randn(5, 1, 8, generator=g)  # [T, H, d]
    freqs = torch.arange(5.0)[:, None] * torch.rand(4, generator=g)  # [T, d/2]
    cos, sin = freqs.cos(), freqs.sin()
    ref_fn = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    # transformers: [B, H, T, d] with cos/sin = cat(freqs, freqs) [B, T, d]
    emb_cos, emb_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    ref_q, ref_k = ref_fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb_cos, emb_sin)
    torch.testing.assert_close(apply_rope(q, cos, sin, interleaved), ref_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rope(k, cos, sin, interleaved), ref_k[0].transpose(0, 1))
