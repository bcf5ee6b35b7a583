"""Checkpoint formats the loader accepts, and the errors it raises for the ones it must not."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaserve.config import ConfigError, ModelConfig
from mlaserve.model import WeightLoadError, load_model
from mlaserve.model.checkpoint_tensor import CheckpointTensor as CT
from mlaserve.model.layers.embedding import VocabParallelEmbedding
from mlaserve.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
)
from mlaserve.model.layers.moe import FusedExperts
from tests.checkpoints import make_checkpoint

Checkpoint = Callable[[str], Path]


def copy_with(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy a single-file checkpoint and let `edit` change its tensors in place."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def load(path: Path, **kwargs: object) -> torch.nn.Module:
    return load_model(ModelConfig.from_pretrained(path), path, **kwargs)


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module, skip: str = "^$") -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        if not re.search(skip, name):
            torch.testing.assert_close(pa[name], pb[name], rtol=0, atol=0, msg=name)


# ----- formats -----


def test_sharded_checkpoint_loads(checkpoint: Checkpoint, tmp_path: Path) -> None:
    sharded = make_checkpoint(tmp_path, "v3_mtp", max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    model = load(sharded)
    assert model.mtp is not None
    assert_same_params(model, load(checkpoint("v3_mtp")))


def test_fused_expert_tensors_load(checkpoint: Checkpoint, tmp_path: Path) -> None:
    """transformers' in-memory layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]."""
    src = checkpoint("v3_moe")
    config = ModelConfig.from_pretrained(src)

    def fuse(state: dict[str, torch.Tensor]) -> None:
        for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
            base = f"model.layers.{layer}.mlp.experts"
            per_expert = [
                {
                    p: state.pop(f"{base}.{e}.{p}.weight")
                    for p in ("gate_proj", "up_proj", "down_proj")
                }
                for e in range(config.n_routed_experts or 0)
            ]
            state[f"{base}.gate_up_proj"] = torch.stack(
                [torch.cat([w["gate_proj"], w["up_proj"]]) for w in per_expert]
            )
            state[f"{base}.down_proj"] = torch.stack([w["down_proj"] for w in per_expert])

    assert_same_params(load(copy_with(src, tmp_path / "fused", fuse)), load(src))


def test_weights_are_cast_to_the_requested_dtype(checkpoint: Checkpoint, tmp_path: Path) -> None:
    src = checkpoint("v3_moe")
    model = load(src, dtype=torch.bfloat16)
    layer = model.model.layers[1]
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert layer.mlp.gate.weight.dtype == torch.float32  # routing stays fp32

    def to_bf16(state: dict[str, torch.Tensor]) -> None:
        state.update({k: v.bfloat16() for k, v in state.items()})

    bf16_ckpt = copy_with(src, tmp_path / "bf16", to_bf16)
    # The fp32 router keeps the fp32 checkpoint's full precision; everything else is identical.
    assert_same_params(load(bf16_ckpt, dtype=torch.bfloat16), model, skip=r"mlp\.gate\.")
    fp32_from_bf16 = load(bf16_ckpt, dtype=torch.float32)
    assert fp32_from_bf16.lm_head.weight.dtype == torch.float32


def test_mtp_config_without_mtp_weights(checkpoint: Checkpoint, tmp_path: Path) -> None:
    """transformers 5 saves num_nextn_predict_layers=1 but never the MTP weights."""
    path = tmp_path / "no_mtp"
    shutil.copytree(checkpoint("v3_moe"), path)
    edit_config(path, num_nextn_predict_layers=1)
    assert load(path).mtp is None


def test_mtp_embedding_and_head_copies_are_optional(checkpoint: Checkpoint, tmp_path: Path) -> None:
    def drop(state: dict[str, torch.Tensor]) -> None:
        del (
            state["model.layers.3.embed_tokens.weight"],
            state["model.layers.3.shared_head.head.weight"],
        )

    model = load(copy_with(checkpoint("v3_mtp"), tmp_path / "tied", drop))
    assert model.mtp.embed_tokens.weight is model.model.embed_tokens.weight
    assert model.mtp.shared_head.head.weight is model.lm_head.weight


def test_unexpected_tensors_are_reported(
    checkpoint: Checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def add(state: dict[str, torch.Tensor]) -> None:
        state["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)

    with caplog.at_level(logging.WARNING, logger="mlaserve.model.loader"):
        load(copy_with(checkpoint("v2_greedy"), tmp_path / "extra", add))
    assert "model.layers.0.self_attn.mystery.weight" in caplog.text


# ----- errors -----


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.1.mlp.experts.5.up_proj.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "lm_head.weight",
        "model.layers.3.eh_proj.weight",  # MTP
    ],
)
def test_missing_weight_is_named(checkpoint: Checkpoint, tmp_path: Path, key: str) -> None:
    path = copy_with(checkpoint("v3_mtp"), tmp_path / "missing", lambda s: s.pop(key))
    with pytest.raises(WeightLoadError, match=f"missing weights: {key}"):
        load(path)


def test_shape_mismatch_is_named(checkpoint: Checkpoint, tmp_path: Path) -> None:
    key = "model.layers.0.self_attn.kv_b_proj.weight"

    def shrink(state: dict[str, torch.Tensor]) -> None:
        state[key] = state[key][:, :31].clone()

    path = copy_with(checkpoint("v3_moe"), tmp_path / "shape", shrink)
    with pytest.raises(WeightLoadError, match=rf"{key}.*expected \[128, 32\], got \[128, 31\]"):
        load(path)


def test_fp8_weights_need_quantization_config(checkpoint: Checkpoint, tmp_path: Path) -> None:
    """FP8 tensors in a checkpoint whose config.json declares no quantization_config (FP8
    checkpoints themselves: tests/model/test_fp8_loading.py)."""
    key = "model.layers.0.self_attn.q_a_proj.weight"

    def quantize(state: dict[str, torch.Tensor]) -> None:
        state[key] = state[key].to(torch.float8_e4m3fn)
        state[key + "_scale_inv"] = torch.ones(1, 1)

    path = copy_with(checkpoint("v3_moe"), tmp_path / "fp8", quantize)
    with pytest.raises(WeightLoadError, match=r"F8_E4M3 but config\.json declares no quantization"):
        load(path)


def test_incomplete_quantization_config_is_rejected(checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = tmp_path / "quant"
    shutil.copytree(checkpoint("v3_moe"), path)
    edit_config(path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match=r"quantization_config\.fmt: missing"):
        ModelConfig.from_pretrained(path)


def test_unknown_model_type_is_rejected(checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = tmp_path / "llama"
    shutil.copytree(checkpoint("v2_greedy"), path)
    edit_config(path, model_type="llama")
    with pytest.raises(ConfigError, match="model_type: 'llama' is not supported"):
        ModelConfig.from_pretrained(path)


# Kimi-K2-Instruct's published config.json (its hyper-parameters; "kimi_k2" names V3's
# architecture) and generation_config.json's end of turn, <|im_end|>.
KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_nextn_predict_layers": 0, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
    "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
    "rope_theta": 50000.0, "bos_token_id": 163584, "eos_token_id": 163585,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "torch_dtype": "bfloat16",
}  # fmt: skip


def test_kimi_k2_reads_as_deepseek_v3_with_its_end_of_turn(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K2))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 163586}))
    mc = ModelConfig.from_pretrained(tmp_path)
    assert mc.model_type == "kimi_k2" and mc.n_routed_experts == 384
    # V3's routing, as for "deepseek_v3", also where a key is left out
    assert (mc.scoring_func, mc.topk_method, mc.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    bare = {k: v for k, v in KIMI_K2.items() if k not in ("scoring_func", "topk_method")}
    v3 = ModelConfig.from_dict({**bare, "model_type": "deepseek_v3"})
    assert ModelConfig.from_dict(bare) == dataclasses.replace(v3, model_type="kimi_k2")
    assert mc.eos_token_ids == (163585, 163586)  # config.json's, then generation_config's
    assert mc.quantization is not None and mc.rope_scaling.factor == 32.0


@pytest.mark.parametrize(("eos", "valid"), [(1, True), ([1], True), ("1", False), ([True], False)])
def test_generation_config_eos_is_added_once_or_refused(tmp_path: Path, eos, valid) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**KIMI_K2, "eos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    if not valid:
        with pytest.raises(ConfigError, match="eos_token_id: expected an int or a list of ints"):
            ModelConfig.from_pretrained(tmp_path)
    else:
        assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (1,)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"generation_config\.json in .*: not JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_no_weights(checkpoint: Checkpoint, tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.mkdir()
    shutil.copy(checkpoint("v2_greedy") / "config.json", path)
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors"):
        load(path)


# ----- tensor-parallel weight loaders (rank 1 of 2) -----


def test_weight_loaders_take_this_ranks_shard() -> None:
    tp = TensorParallel(rank=1, size=2)
    full = torch.arange(8 * 4, dtype=torch.float32).view(8, 4)

    col = ColumnParallelLinear(4, 8, tp=tp)
    col.weight.weight_loader(col.weight, CT.from_tensor(full))
    torch.testing.assert_close(col.weight.data, full[4:])

    row = RowParallelLinear(4, 8, tp=tp)
    row.weight.weight_loader(row.weight, CT.from_tensor(full))
    torch.testing.assert_close(row.weight.data, full[:, 2:])

    merged = MergedColumnParallelLinear(4, [8, 8], tp=tp)
    merged.weight.weight_loader(merged.weight, CT.from_tensor(full), shard_id=0)
    merged.weight.weight_loader(merged.weight, CT.from_tensor(full + 100), shard_id=1)
    torch.testing.assert_close(merged.weight.data, torch.cat([full[4:], full[4:] + 100]))

    emb = VocabParallelEmbedding(8, 4, tp=tp)
    emb.weight.weight_loader(emb.weight, CT.from_tensor(full))
    torch.testing.assert_close(emb.weight.data, full[4:])

    experts = FusedExperts(2, 4, 8, tp=tp)  # E=2, H=4, I=8
    gate_up = torch.randn(2, 16, 4)
    experts.weight_loader(experts.gate_up_proj, CT.from_tensor(gate_up))
    by_expert = FusedExperts(2, 4, 8, tp=tp)
    for e in range(2):
        for s in range(2):
            by_expert.weight_loader(
                by_expert.gate_up_proj,
                CT.from_tensor(gate_up[e, s * 8 : (s + 1) * 8]),
                expert_id=e,
                shard_id=s,
            )
    torch.testing.assert_close(experts.gate_up_proj.data, by_expert.gate_up_proj.data)
    torch.testing.assert_close(experts.gate_up_proj.data[:, :4], gate_up[:, 4:8])  # gate, rank 1
    torch.testing.assert_close(experts.gate_up_proj.data[:, 4:], gate_up[:, 12:])  # up, rank 1

    with pytest.raises(ValueError, match=r"expected \[8, 4\], got \[8, 3\]"):
        col.weight.weight_loader(col.weight, CT.from_tensor(full[:, :3]))


@pytest.mark.parametrize("name", ["v2_no_q_lora", "v3_moe"])
def test_q_and_kv_a_projections_load_as_one_weight(checkpoint: Checkpoint, name: str) -> None:
    """q_a_proj (V3) or q_proj (V2) and kv_a_proj_with_mqa are stored stacked, in that order, in
    `fused_qkv_a_proj_with_mqa` (one GEMM); rank 1 of 2 keeps V2's q_proj column-parallel and
    apart, since its layout differs from kv_a's (replicated)."""
    path = checkpoint(name)
    state = load_file(path / "model.safetensors")
    config = ModelConfig.from_pretrained(path)
    q = "q_a_proj" if config.q_lora_rank is not None else "q_proj"
    attn = load(path).model.layers[0].self_attn
    prefix = "model.layers.0.self_attn."
    expected = torch.cat(
        [state[f"{prefix}{q}.weight"], state[f"{prefix}kv_a_proj_with_mqa.weight"]]
    )
    torch.testing.assert_close(
        attn.fused_qkv_a_proj_with_mqa.weight.data, expected.float(), rtol=0, atol=0
    )
    assert not hasattr(attn, q) and not hasattr(attn, "kv_a_proj_with_mqa")

    from mlaserve.model.layers.mla import MLAAttention

    split = MLAAttention(config, 0, tp=TensorParallel(rank=1, size=2))
    assert (split.fused_qkv_a_proj_with_mqa is None) == (config.q_lora_rank is None)
