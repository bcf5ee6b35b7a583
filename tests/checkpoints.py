"""Tiny random DeepSeek-V2/V3 checkpoints in the real HF format, for everyone's tests.

    path = make_checkpoint(tmp_path, "v3_moe")          # config.json, model.safetensors, tokenizer
    ref = make_reference_model(path)                    # transformers' model, fp32, eval

Weights are written by transformers' own `DeepseekV{2,3}ForCausalLM.save_pretrained` (per-expert
`mlp.experts.{e}.*` keys, like the published checkpoints), in fp32. The MTP layer
(`model.layers.{N}.*`) that transformers does not model is appended by hand. Initialisation is
wider than transformers' default (std 0.08, norms 1 +- 0.1, random correction bias), so logits
are far from flat and a swapped or missing weight changes the output.

The tokenizer is a byte-level BPE trained on a fixed text (ids 0/1/2 = <bos>/<eos>/<pad>, bos is
prepended on encode) with a small chat template in tokenizer_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["VARIANTS", "make_checkpoint", "make_reference_model", "make_tokenizer"]

INIT_STD = 0.08
BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
_TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. Multi-head latent attention compresses keys "
    "and values into a small latent vector, and a mixture of experts routes every token to a "
    "few experts. Hello world! How are you today? I am fine, thank you. The answer is 42. "
    "user: what is the capital of France? assistant: Paris. 0123456789 +-*/=()[]{}<>,.;:!?'\"\n"
)

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # transformers' default (128) would break its MLA reference
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}
_V3: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_mtp_layers": 0,
}
_V2: dict[str, Any] = {"model_type": "deepseek_v2", "routed_scaling_factor": 1.5}
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}

#: name -> config overrides. Special keys: "mtp" (append an MTP layer), "legacy_rope" (rewrite
#: config.json into the published `rope_theta` + `rope_scaling` form).
VARIANTS: dict[str, dict[str, Any]] = {
    "v3_moe": {**_V3},
    "v3_no_q_lora": {**_V3, "q_lora_rank": None},
    "v3_yarn": {**_V3, "rope_parameters": _YARN, "max_position_embeddings": 128},
    "v3_yarn_no_interleave": {
        **_V3,
        "rope_parameters": _YARN,
        "rope_interleave": False,
        "max_position_embeddings": 128,
    },
    "v3_dense": {**_V3, "first_k_dense_replace": 3},
    "v3_mtp": {**_V3, "mtp": True},
    "v2_greedy": {**_V2, "topk_method": "greedy"},
    "v2_group_limited": {
        **_V2,
        "topk_method": "group_limited_greedy",
        "n_group": 2,
        "topk_group": 1,
    },
    "v2_no_q_lora": {**_V2, "q_lora_rank": None, "n_shared_experts": 2},
    "v2_yarn_legacy": {
        **_V2,
        "legacy_rope": True,
        "max_position_embeddings": 128,
        "rope_parameters": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
}


def make_checkpoint(
    tmp_dir: str | Path,
    variant: str,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Write checkpoint `variant` (a key of VARIANTS) under tmp_dir/variant; return its path.

    `max_shard_size` (e.g. "40KB") writes sharded safetensors with model.safetensors.index.json.
    """
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    if variant not in VARIANTS:
        raise ValueError(
            f"unknown checkpoint variant {variant!r}; expected one of {list(VARIANTS)}"
        )
    settings = {**_COMMON, **VARIANTS[variant], **config_overrides}
    with_mtp = bool(settings.pop("mtp", False))
    legacy_rope = bool(settings.pop("legacy_rope", False))
    model_type = settings.pop("model_type")
    is_v3 = model_type == "deepseek_v3"
    config_cls, model_cls = (
        (DeepseekV3Config, DeepseekV3ForCausalLM)
        if is_v3
        else (DeepseekV2Config, DeepseekV2ForCausalLM)
    )
    path = Path(tmp_dir) / variant
    path.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            _init_(name, tensor, generator)
    shard_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **shard_kwargs)

    config = json.loads((path / "config.json").read_text())
    if with_mtp:
        _append_mtp_layer(path, config["num_hidden_layers"], generator)
        config["num_nextn_predict_layers"] = 1
    if legacy_rope:
        params = config.pop("rope_parameters")
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    make_tokenizer(path)
    return path


def make_reference_model(path: str | Path) -> torch.nn.Module:
    """transformers' model for the checkpoint at `path`: fp32, eager attention, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def make_tokenizer(path: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) into `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TOKENIZER_TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.save_pretrained(path)
    # Published checkpoints keep the template in tokenizer_config.json, not chat_template.jinja.
    (Path(path) / "chat_template.jinja").unlink(missing_ok=True)
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2))


def _init_(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    noise = torch.randn(tensor.shape, generator=generator)
    if name.endswith("e_score_correction_bias"):
        tensor.copy_(0.1 * noise)
    elif "norm" in name:  # RMSNorm weights
        tensor.copy_(1.0 + 0.1 * noise)
    elif tensor.is_floating_point():
        tensor.copy_(INIT_STD * noise)


def _append_mtp_layer(path: Path, num_layers: int, generator: torch.Generator) -> None:
    """Add DeepSeek-V3's MTP tensors `model.layers.{N}.*`: a copy of the last (MoE) layer's
    structure with fresh weights, plus enorm/hnorm/eh_proj/shared_head and the embedding/head
    copies the published checkpoints carry."""
    from safetensors.torch import load_file, save_file

    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        state = {}
        for file in sorted(set(index["weight_map"].values())):
            state.update(load_file(path / file))
    else:
        index = None
        state = load_file(path / "model.safetensors")

    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    hidden = state["model.norm.weight"].shape[0]
    extra: dict[str, torch.Tensor] = {}
    for key in sorted(state):  # sorted: the same weights however the checkpoint is sharded
        if key.startswith(last):
            extra[mtp + key.removeprefix(last)] = torch.empty_like(state[key])
    extra[mtp + "enorm.weight"] = torch.empty(hidden)
    extra[mtp + "hnorm.weight"] = torch.empty(hidden)
    extra[mtp + "eh_proj.weight"] = torch.empty(hidden, 2 * hidden)
    extra[mtp + "shared_head.norm.weight"] = torch.empty(hidden)
    for key, tensor in extra.items():
        _init_(key, tensor, generator)
    extra[mtp + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    extra[mtp + "shared_head.head.weight"] = state["lm_head.weight"].clone()

    if index is None:
        save_file({**state, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    else:
        save_file(extra, path / "model-mtp.safetensors", metadata={"format": "pt"})
        index["weight_map"].update({key: "model-mtp.safetensors" for key in extra})
        index_file.write_text(json.dumps(index, indent=2))
