"""FP8 block-quantized checkpoints (the published DeepSeek-V3 / R1 / Kimi-K2 format) on CPU.

Checkpoints are transformers-saved tiny models quantised by tools/fp8_checkpoint.py, with dims
that are multiples of 128 (`aligned`) and that are not (partial blocks, per-row gate|up scales).
The reference for each is the same FP8 checkpoint multiplied out to fp32.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mlaserve.config import ConfigError, ModelConfig, QuantizationConfig
from mlaserve.model import WeightLoadError, load_model
from tests.checkpoints import make_checkpoint
from tests.model.fp8_checkpoints import fp8_pair, max_rel, prompt_logits, token_rel
from tools.fp8_checkpoint import quantize_checkpoint_fp8_block

FP32_MAX_REL = 1e-4
# keep_fp8 on CPU = the emulated FP8 math: activations quantised per token and 128-group to
# e4m3 (3 mantissa bits), times the exact dequantised weights. Against the dequantised fp32
# model, measured 2026-11-22 on these random tiny models (whose logits swing on every MoE
# routing flip): median token_rel 0.055-0.146, argmax agreement 0.72-0.85. With exact
# activations the same path matches to 0.0 (checked by hand), so what is left is e4m3 itself.
EMULATED_MEDIAN_BOUND = 0.25
EMULATED_ARGMAX_MIN = 0.6

CASES = [("v3_mtp", True), ("v3_moe", False), ("v2_no_q_lora", False)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("fp8")
    cache: dict[tuple, tuple[Path, Path]] = {}

    def get(variant: str, aligned: bool, scale_name: str = "weight_scale_inv"):
        key = (variant, aligned, scale_name)
        if key not in cache:
            cache[key] = fp8_pair(root, variant, aligned=aligned, scale_name=scale_name)
        return cache[key]

    return get


def load(path: Path, **kwargs: object) -> torch.nn.Module:
    return load_model(ModelConfig.from_pretrained(path), path, **kwargs)


# ----- config -----


def test_published_quantization_config_parses() -> None:
    d = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    q = QuantizationConfig.from_dict({**d, "activation_scheme": "dynamic"})
    assert q == QuantizationConfig() and q.to_dict()["weight_block_size"] == [128, 128]
    assert QuantizationConfig.from_dict({**q.to_dict(), "modules_to_not_convert": None}) == q


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"quant_method": "awq"}, "quantization_config.quant_method"),
        ({"fmt": "e5m2"}, "quantization_config.fmt"),
        ({"weight_block_size": [64, 64]}, "quantization_config.weight_block_size"),
        ({"weight_block_size": 128}, "quantization_config.weight_block_size"),
        ({"activation_scheme": "static"}, "quantization_config.activation_scheme"),
        ({"ignored_layers": ["lm_head"]}, "quantization_config.ignored_layers"),
        ({"kv_cache_scheme": {"num_bits": 8}}, "quantization_config.kv_cache_scheme"),
    ],
)
def test_unsupported_quantization_is_named(change: dict, key: str) -> None:
    d = {**QuantizationConfig().to_dict(), **change}
    with pytest.raises(ConfigError, match=key):
        QuantizationConfig.from_dict(d)


def test_missing_quantization_key_is_named() -> None:
    d = QuantizationConfig().to_dict()
    del d["fmt"]
    with pytest.raises(ConfigError, match=r"quantization_config\.fmt: missing"):
        QuantizationConfig.from_dict(d)


# ----- the format we write is the published one -----


def test_checkpoint_format(pair: Callable[..., tuple[Path, Path]]) -> None:
    fp8, _ = pair("v3_mtp", True)
    assert ModelConfig.from_pretrained(fp8).quantization == QuantizationConfig()
    with safe_open(fp8 / "model.safetensors", framework="pt") as f:
        w = f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight")  # [144, 256]
        s = f.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert list(s.shape) == [2, 2]  # ceil(144/128) x ceil(256/128): a partial row block
        for bf16_key in (
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.1.mlp.gate.weight",
            "model.layers.3.eh_proj.weight",
        ):
            assert f.get_tensor(bf16_key).dtype != torch.float8_e4m3fn, bf16_key


# ----- CPU: dequantised at load, the same model as the dequantised checkpoint -----


@pytest.mark.parametrize(("variant", "aligned"), CASES)
def test_dequantised_at_load_matches_dequantised_checkpoint(
    variant: str, aligned: bool, pair: Callable[..., tuple[Path, Path]]
) -> None:
    fp8, plain = pair(variant, aligned)
    config = ModelConfig.from_pretrained(fp8)
    model = load(fp8)  # CPU default: dequantise
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters()), "no FP8 on CPU"
    err = max_rel(prompt_logits(model, config), prompt_logits(load(plain), config))
    assert err <= FP32_MAX_REL, f"max_rel {err:.2e}"


def test_scale_named_dot_scale_loads_the_same(pair: Callable[..., tuple[Path, Path]]) -> None:
    fp8, _ = pair("v3_moe", False)
    alt, _ = pair("v3_moe", False, scale_name="scale")
    assert "model.layers.1.self_attn.o_proj.scale" in load_file(alt / "model.safetensors")
    for keep in (False, True):
        a, b = dict(load(fp8, keep_fp8=keep).named_parameters()), load(alt, keep_fp8=keep)
        for name, p in b.named_parameters():
            assert torch.equal(p.float(), a[name].float()), name


# ----- CPU, kept in FP8 (the emulated math of the GPU kernels) -----


@pytest.mark.parametrize(("variant", "aligned"), CASES)
def test_kept_fp8_weights_and_logits(
    variant: str, aligned: bool, pair: Callable[..., tuple[Path, Path]]
) -> None:
    fp8, plain = pair(variant, aligned)
    config = ModelConfig.from_pretrained(fp8)
    model = load(fp8, keep_fp8=True)
    params = dict(model.named_parameters())
    layer = "model.layers.1."
    for name in (
        "self_attn.o_proj.weight",
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
        "mlp.shared_experts.gate_up_proj.weight",
    ):
        assert params[layer + name].dtype == torch.float8_e4m3fn, name
    assert params[layer + "self_attn.kv_b_proj.weight"].dtype == torch.float32  # absorbed
    assert params[layer + "mlp.gate.weight"].dtype == torch.float32  # router
    assert params["lm_head.weight"].dtype == torch.float32
    gate_up_scale = params[layer + "mlp.experts.gate_up_proj_scale_inv"]
    i, h = config.moe_intermediate_size, config.hidden_size
    # aligned: true blocks; odd (I = 32): the gate|up seam is mid-block, so one scale per row
    assert list(gate_up_scale.shape) == ([8, 2, 2] if aligned else [8, 2 * i, -(-h // 128)])

    ours, ref = prompt_logits(model, config), prompt_logits(load(plain), config)
    rel = token_rel(ours, ref)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert rel.median() <= EMULATED_MEDIAN_BOUND, f"median token_rel {rel.median():.3f}"
    assert agree >= EMULATED_ARGMAX_MIN, f"argmax agreement {agree:.2f}"


# ----- bad input -----

O_PROJ = "model.layers.1.self_attn.o_proj"


def broken(pair: Callable[..., tuple[Path, Path]], tmp_path: Path, edit) -> Path:
    fp8, _ = pair("v3_moe", False)
    dst = tmp_path / "broken"
    shutil.copytree(fp8, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda s: s.pop(f"{O_PROJ}.weight_scale_inv"),
            rf"{O_PROJ}\.weight: FP8 weight has no block scale",
        ),
        (
            lambda s: s[f"{O_PROJ}.weight_scale_inv"].fill_(float("nan")),
            rf"{O_PROJ}\.weight_scale_inv: block scale is corrupt",
        ),
        (
            lambda s: s[f"{O_PROJ}.weight_scale_inv"].zero_(),
            rf"{O_PROJ}\.weight_scale_inv: block scale is corrupt",
        ),
        (
            lambda s: s.update({f"{O_PROJ}.weight_scale_inv": torch.ones(2, 1)}),
            rf"{O_PROJ}\.weight_scale_inv: block scale shape \[2, 1\] does not match .* \(expected \[1, 1\]\)",
        ),
        (
            lambda s: s.update({f"{O_PROJ}.weight_scale_inv": torch.ones(1, 1, dtype=torch.int32)}),
            rf"{O_PROJ}\.weight_scale_inv: block scale must be a float tensor",
        ),
    ],
    ids=["missing", "nan", "zero", "shape", "dtype"],
)
@pytest.mark.parametrize("keep_fp8", [False, True])
def test_bad_scales_are_named(
    edit, match: str, keep_fp8: bool, pair: Callable[..., tuple[Path, Path]], tmp_path: Path
) -> None:
    path = broken(pair, tmp_path, edit)
    with pytest.raises(WeightLoadError, match=match):
        load(path, keep_fp8=keep_fp8)


def test_fp8_weights_without_quantization_config(
    pair: Callable[..., tuple[Path, Path]], tmp_path: Path
) -> None:
    path = broken(pair, tmp_path, lambda s: None)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"F8_E4M3 but config\.json declares no quantization"):
        load(path)


def test_float_weight_in_fp8_checkpoint_is_quantised_on_load(
    pair: Callable[..., tuple[Path, Path]], tmp_path: Path
) -> None:
    """A re-export that left one projection in bf16: the FP8 layer quantises it itself."""
    fp8, _ = pair("v3_moe", False)
    ref = load_file(fp8 / "model.safetensors")
    w = ref[f"{O_PROJ}.weight"].float() * ref[f"{O_PROJ}.weight_scale_inv"]

    def to_float(state: dict[str, torch.Tensor]) -> None:
        state[f"{O_PROJ}.weight"] = w.bfloat16()
        del state[f"{O_PROJ}.weight_scale_inv"]

    model = load(broken(pair, tmp_path, to_float), keep_fp8=True)
    o_proj = model.model.layers[1].self_attn.o_proj
    assert o_proj.weight.dtype == torch.float8_e4m3fn
    back = o_proj.weight.float() * o_proj.weight_scale_inv
    assert max_rel(back, w) < 0.07  # one e4m3 rounding (2^-4) of a bf16 rounding


def test_tool_writes_fused_experts_per_expert(tmp_path: Path) -> None:
    """transformers' fused expert tensors come out as the published per-expert FP8 tensors."""
    src = make_checkpoint(tmp_path / "src", "v3_moe")
    config = ModelConfig.from_pretrained(src)
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    state = load_file(fused / "model.safetensors")
    for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
        base = f"model.layers.{layer}.mlp.experts"
        experts = range(config.n_routed_experts or 0)
        gate_up = [
            torch.cat([state.pop(f"{base}.{e}.{p}.weight") for p in ("gate_proj", "up_proj")])
            for e in experts
        ]
        state[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{base}.down_proj"] = torch.stack(
            [state.pop(f"{base}.{e}.down_proj.weight") for e in experts]
        )
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    a = load_file(quantize_checkpoint_fp8_block(src, tmp_path / "a") / "model.safetensors")
    b = load_file(quantize_checkpoint_fp8_block(fused, tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].float(), b[key].float()), key


def test_engine_serves_an_fp8_checkpoint(pair: Callable[..., tuple[Path, Path]]) -> None:
    """End to end through LLM on CPU: the FP8 checkpoint generates what its dequantised twin
    generates (greedy, batched)."""
    from mlaserve import LLM, SamplingParams

    fp8, plain = pair("v3_moe", False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 99, 3], [200, 7, 7, 41, 8, 150]]
    outs = []
    for path in (fp8, plain):
        llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="auto", page_size=4)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]
    assert all(len(ids) == 8 for ids in outs[0])
