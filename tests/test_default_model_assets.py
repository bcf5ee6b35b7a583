"""The default model shipped in the package (`mlaserve/assets/default-model`): it loads with
transformers, has the shapes the MLA kernels need and DeepSeek's MTP layout, fits the size
budget, and is actually trained (its greedy continuation looks like Python and its MTP head
predicts two tokens ahead far better than chance). CPU only."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, DeepseekV3ForCausalLM, PreTrainedTokenizerBase

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "mlaserve" / "assets" / "default-model"
MAX_BYTES = 32_000_000
FILES = (
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((FOLDER / "config.json").read_text())


@pytest.fixture(scope="module")
def loaded() -> tuple[DeepseekV3ForCausalLM, dict]:
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        FOLDER, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(FOLDER)


@pytest.fixture(scope="module")
def tensors() -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype), read from the header only."""
    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        return {
            name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
            for name in f.keys()  # noqa: SIM118 (safe_open has no __iter__)
        }


def common_module() -> ModuleType:
    """tools/default_model_common.py (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "default_model_common", ROOT / "tools" / "default_model_common.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being created
    spec.loader.exec_module(module)
    return module


def test_folder_is_complete_and_within_budget() -> None:
    names = {p.name for p in FOLDER.iterdir()}
    assert set(FILES) <= names
    size = sum(p.stat().st_size for p in FOLDER.iterdir() if p.is_file())
    assert size <= MAX_BYTES, f"{size:,} bytes"


def test_config_has_the_dims_the_mla_kernels_need(config: dict) -> None:
    assert config["model_type"] == "deepseek_v3"
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["kv_lora_rank"] == 512
    assert config["qk_rope_head_dim"] == 64
    # The decode kernels see only the 576-wide latent; nope/v heads may be smaller than V3's.
    assert 0 < config["qk_nope_head_dim"] <= 128 and 0 < config["v_head_dim"] <= 128
    assert config["num_attention_heads"] == 16
    assert config["num_nextn_predict_layers"] == 1
    assert config["first_k_dense_replace"] == 1
    assert config["num_hidden_layers"] >= 8  # a draft step is a small part of a target step
    assert config["num_hidden_layers"] > config["first_k_dense_replace"]  # has MoE layers
    assert config["n_shared_experts"] == 1
    assert config["norm_topk_prob"] is True
    assert config["n_routed_experts"] % config["n_group"] == 0
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"


def test_main_model_loads_every_weight(
    loaded: tuple[DeepseekV3ForCausalLM, dict], config: dict
) -> None:
    _, info = loaded
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    # The only keys transformers does not use are the MTP module's.
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    assert info["unexpected_keys"]
    assert all(key.startswith(mtp_prefix) for key in info["unexpected_keys"])


def test_checkpoint_uses_deepseek_names_and_dtypes(tensors: dict, config: dict) -> None:
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    heads = config["num_attention_heads"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    # Experts are stored one Linear per expert, as in the published checkpoints, not fused.
    assert not any("gate_up_proj" in name for name in tensors)
    assert all(
        dtype == ("F32" if name.endswith("e_score_correction_bias") else "BF16")
        for name, (_, dtype) in tensors.items()
    )
    moe = f"model.layers.{config['first_k_dense_replace']}.mlp."
    assert tensors[moe + "gate.weight"][0] == (experts, hidden)
    assert tensors[moe + "gate.e_score_correction_bias"][0] == (experts,)
    assert tensors[moe + f"experts.{experts - 1}.gate_proj.weight"][0] == (inter, hidden)
    assert tensors[moe + f"experts.{experts - 1}.down_proj.weight"][0] == (hidden, inter)

    mtp = f"model.layers.{config['num_hidden_layers']}."
    expected = {
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden),
        "embed_tokens.weight": (vocab, hidden),
        "shared_head.norm.weight": (hidden,),
        "shared_head.head.weight": (vocab, hidden),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.kv_a_proj_with_mqa.weight": (config["kv_lora_rank"] + 64, hidden),
        "self_attn.kv_b_proj.weight": (heads * (nope + v), config["kv_lora_rank"]),
        "self_attn.o_proj.weight": (hidden, heads * v),
        "mlp.gate.weight": (experts, hidden),
        "mlp.gate.e_score_correction_bias": (experts,),
        "mlp.shared_experts.gate_proj.weight": (inter * config["n_shared_experts"], hidden),
        **{f"mlp.experts.{e}.up_proj.weight": (inter, hidden) for e in range(experts)},
    }
    for name, shape in expected.items():
        assert tensors[mtp + name][0] == shape, name
    # The MTP module is a full MoE decoder layer: same tensor names as the last main layer.
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    main_layer = {n.removeprefix(last) for n in tensors if n.startswith(last)}
    mtp_layer = {n.removeprefix(mtp) for n in tensors if n.startswith(mtp)}
    assert main_layer <= mtp_layer


def test_mtp_embedding_and_head_are_copies_of_the_main_ones(config: dict) -> None:
    mtp = f"model.layers.{config['num_hidden_layers']}."
    with safe_open(str(FOLDER / "model.safetensors"), framework="pt") as f:
        assert torch.equal(
            f.get_tensor(mtp + "embed_tokens.weight"), f.get_tensor("model.embed_tokens.weight")
        )
        assert torch.equal(
            f.get_tensor(mtp + "shared_head.head.weight"), f.get_tensor("lm_head.weight")
        )


def test_tokenizer(tokenizer: PreTrainedTokenizerBase, config: dict) -> None:
    assert 4096 <= len(tokenizer) <= 8192
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.bos_token_id == config["bos_token_id"]
    assert tokenizer.eos_token_id == config["eos_token_id"]
    assert tokenizer.pad_token_id == config["pad_token_id"]
    text = "def f(x):\n    return x  # é\n"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith(tokenizer.bos_token) and "hi" in chat


def test_greedy_continuation_looks_like_python(
    loaded: tuple[DeepseekV3ForCausalLM, dict], tokenizer: PreTrainedTokenizerBase
) -> None:
    model, _ = loaded
    prompt = "def fibonacci(n):"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=48, do_sample=False)
    continuation = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert re.search(r"\b(return|if)\b", continuation), continuation
    # An indented body follows the signature.
    assert continuation.startswith("\n    "), continuation


def test_mtp_head_predicts_two_tokens_ahead(
    loaded: tuple[DeepseekV3ForCausalLM, dict], tokenizer: PreTrainedTokenizerBase
) -> None:
    """On a held-out stdlib file, the MTP module (loaded from the checkpoint's DeepSeek names)
    must guess t_{i+2} far more often than the most frequent token could."""
    common = common_module()
    model, _ = loaded
    doc = common.read_documents(ROOT / "tools" / "data" / "default_model_heldout.jsonl.gz")[0]
    # 4000 characters are well over 512 tokens (about 3.5 characters a token).
    ids = tokenizer(doc.text[:4000], return_tensors="pt").input_ids[:, :512]
    assert ids.shape[1] == 512
    mtp = common.load_mtp_layer(FOLDER, model)
    with torch.no_grad():
        _, mtp_logits = common.forward_main_and_mtp(model, mtp, ids[:, :-1])
    targets = ids[0, 2:]
    accuracy = (mtp_logits[0].argmax(-1) == targets).float().mean().item()
    most_frequent = targets.bincount().max().item() / targets.numel()
    assert accuracy > max(0.2, 2 * most_frequent), (accuracy, most_frequent)
