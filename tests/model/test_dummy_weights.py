"""`load_format="dummy"`: random weights from config.json alone (no safetensors), seeded, finite
through the whole forward, FP8 block weights + scales where the config quantizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.config import ConfigError, EngineConfig, ModelConfig, default_model_path
from mlaserve.model import WeightLoadError, load_model
from mlaserve.model.layers.moe import DeepseekMoE
from mlaserve.ops.fp8_quant import FP8_DTYPE
from tests.model.fp8_checkpoints import prompt_logits

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")
# V3-lite's layout (bench/make_checkpoint.py --arch v3: q without LoRA, sigmoid routing with a
# correction bias, 2 shared experts) at tiny width, with DeepSeek-V3's FP8 block quantization;
# widths that are not multiples of 128 give partial blocks and per-row gate|up scales.
V3_LITE_FP8 = {
    "model_type": "deepseek_v3",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 320,
    "moe_intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 2,
    "n_routed_experts": 16,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 128,
    "q_lora_rank": None,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 512,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
}


def config_folder(path: Path, config: dict | None = None, tokenizer: bool = True) -> Path:
    """A model folder without weights: config.json (the default model's, or `config`) and the
    default model's tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    src = default_model_path()
    if config is None:
        shutil.copy(src / "config.json", path)
    else:
        (path / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER if tokenizer else ():
        shutil.copy(src / name, path)
    return path


def dummy(path: Path, seed: int = 0, **kwargs: object) -> torch.nn.Module:
    return load_model(
        ModelConfig.from_pretrained(path), path, load_format="dummy", seed=seed, **kwargs
    )


@pytest.fixture(scope="module")
def default_folder(tmp_path_factory) -> Path:
    return config_folder(tmp_path_factory.mktemp("dummy") / "default")


def test_llm_generates_from_config_alone(default_folder: Path) -> None:
    assert not list(default_folder.glob("*.safetensors"))
    kwargs = {"device": "cpu", "dtype": "bfloat16", "kv_cache_dtype": "auto", "page_size": 4}
    outs = [
        LLM(str(default_folder), load_format="dummy", seed=seed, **kwargs).generate(
            ["Hello world", "The answer is"], GREEDY, use_tqdm=False
        )
        for seed in (0, 0, 1)
    ]
    ids = [[o.outputs[0].token_ids for o in out] for out in outs]
    assert all(len(t) == 4 for t in ids[0])
    assert ids[0] == ids[1]  # same seed, same weights, same greedy tokens
    assert ids[0] != ids[2]


def test_seeded_weights_and_finite_logits(default_folder: Path) -> None:
    a, b, c = dummy(default_folder), dummy(default_folder), dummy(default_folder, seed=1)
    assert a.mtp is not None  # the config asks for an MTP layer: a dummy load builds it
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    for name, param in pa.items():
        assert torch.equal(param, pb[name]), name
        if param.dim() > 1:
            assert not torch.equal(param, pc[name]), name
    norms = [p for n, p in pa.items() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    config = ModelConfig.from_pretrained(default_folder)
    logits = prompt_logits(a, config)
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3  # O(1): neither flat nor saturated


def test_fp8_config_makes_block_weights_and_scales(tmp_path: Path) -> None:
    path = config_folder(tmp_path / "v3lite", V3_LITE_FP8)
    model = dummy(path, dtype=torch.bfloat16, keep_fp8=True)  # the emulated FP8 math on CPU
    params = dict(model.named_parameters())
    fp8 = {n: p for n, p in params.items() if p.dtype == FP8_DTYPE}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fp8
    assert "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight" in fp8
    for name, weight in fp8.items():
        scale = params[name + "_scale_inv"]
        assert scale.dtype == torch.float32 and bool((scale > 0).all()), name
        assert scale.shape[-1] == -(-weight.shape[-1] // 128), name
        assert weight.float().abs().max() > 1, name  # e4m3 values used, not rounded to 0
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj_scale_inv.shape == (16, 2 * 96, 2)  # per-row: 96 % 128
    assert experts.down_proj_scale_inv.shape == (16, 2, 1)
    attn = model.model.layers[0].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.bfloat16  # never FP8, as in a real load
    assert attn.w_uk.data_ptr() == attn.kv_b_proj.weight.data_ptr()  # derived after the fill

    config = ModelConfig.from_pretrained(path)
    routed = []
    hook = lambda m, args: routed.append(m.gate(args[0])[1].unique().numel())  # noqa: E731
    for module in model.modules():
        if isinstance(module, DeepseekMoE):
            module.register_forward_pre_hook(hook)
    logits = prompt_logits(model, config, kv_dtype=torch.bfloat16)
    assert torch.isfinite(logits).all()
    assert routed and min(routed) >= 12  # tokens spread over the 16 experts, not collapsed


def test_bad_load_format_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"load_format: expected one of \('auto', 'dummy'\)"):
        EngineConfig(load_format="random")
    with pytest.raises(WeightLoadError, match="load_format"):
        load_model(ModelConfig.from_pretrained(default_model_path()), ".", load_format="x")


def test_missing_config_or_tokenizer_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        LLM(str(empty), load_format="dummy", device="cpu")
    bare = config_folder(tmp_path / "bare", tokenizer=False)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        LLM(str(bare), load_format="dummy", device="cpu")
