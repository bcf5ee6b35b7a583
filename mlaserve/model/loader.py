"""Load a HF DeepSeek-V2/V3 safetensors checkpoint into `DeepseekForCausalLM`.

Checkpoint key -> parameter mapping (the only places our names differ from HF's):

    model.layers.{i}.mlp[.shared_experts].{gate,up}_proj.weight -> ...gate_up_proj.weight [0|1]
    model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight  -> mlp.experts.gate_up_proj [e][0|1]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight       -> mlp.experts.down_proj [e]
      (or transformers' fused `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I])
    model.layers.{N}.{enorm,hnorm,eh_proj,embed_tokens,shared_head.*} -> mtp.*    (N = #layers)
    model.layers.{N}.{self_attn,mlp,*_layernorm}.*                    -> mtp.block.*

FP8-KV checkpoints may carry a per-layer latent-cache scale (`model.layers.{i}.self_attn.k_scale`,
or `kv_scale`, or under `self_attn.attn.`): `load_kv_scales` reads those for the KV pool.

Each tensor goes through its parameter's `weight_loader` (which takes this rank's TP shard)
and is cast to the parameter dtype. Every failure raises `WeightLoadError` naming the key.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mlaserve.config import ModelConfig
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.layers.linear import NO_TP, TensorParallel, default_weight_loader

__all__ = ["WeightLoadError", "load_kv_scales", "load_model", "load_weights"]

logger = logging.getLogger(__name__)

_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_KV_SCALE_KEY = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(?:k_scale|kv_scale)$")
# MTP copies that some checkpoints drop; absent ones are tied to the main model's.
_MTP_TIED = {
    "mtp.embed_tokens.weight": "model.embed_tokens.weight",
    "mtp.shared_head.head.weight": "lm_head.weight",
}


class WeightLoadError(ValueError):
    """The checkpoint's weights cannot be loaded; the message names the key and the problem."""


@dataclass(frozen=True)
class _Route:
    param_name: str
    kwargs: dict[str, Any]


def load_model(
    model_config: ModelConfig,
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp: TensorParallel = NO_TP,
) -> DeepseekForCausalLM:
    """Build the model on `device` in `dtype`, load the checkpoint at `path`, eval mode, no grad.

    The MTP module is built when the config asks for one and the checkpoint carries it."""
    if dtype not in _MODEL_DTYPES:
        raise WeightLoadError(f"dtype: expected one of {_MODEL_DTYPES}, got {dtype}")
    path = Path(path)
    index = _index_checkpoint(path)
    mtp_prefix = f"model.layers.{model_config.num_hidden_layers}."
    with_mtp = model_config.num_nextn_predict_layers > 0 and any(
        key.startswith(mtp_prefix) for key in index
    )
    if model_config.num_nextn_predict_layers > 0 and not with_mtp:
        logger.info("config has num_nextn_predict_layers but %s has no MTP weights", path)
    with torch.device(device):
        model = DeepseekForCausalLM(model_config, params_dtype=dtype, tp=tp, with_mtp=with_mtp)
    load_weights(model, path, index)
    model.process_weights_after_loading()
    return model.eval().requires_grad_(False)


def load_weights(
    model: DeepseekForCausalLM, path: Path, index: dict[str, tuple[Path, str]] | None = None
) -> None:
    """Copy every checkpoint tensor into its parameter; raise on anything missing or wrong."""
    index = _index_checkpoint(path) if index is None else index
    config = model.config
    params = dict(model.named_parameters())
    routes: dict[str, _Route] = {}
    required: dict[str, tuple[list[str], str | None]] = {}
    for name in params:
        keys, fused = _checkpoint_keys(name, config)
        required[name] = ([key for key, _ in keys], fused)
        routes.update({key: _Route(name, kwargs) for key, kwargs in keys})
        if fused is not None:
            routes[fused] = _Route(name, {})

    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in sorted({file for file, _ in index.values()}):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                route = routes.get(key)
                if route is None:
                    unexpected.append(key)
                    continue
                dtype = index[key][1]
                if dtype not in _FLOAT_DTYPES:
                    raise WeightLoadError(f"{key}: unsupported weight dtype {dtype}")
                param = params[route.param_name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, f.get_tensor(key), **route.kwargs)
                except ValueError as e:
                    raise WeightLoadError(f"{key} in {file.name}: {e}") from None
                loaded.add(key)

    for name, source in _MTP_TIED.items():
        if name in required and not set(required[name][0]) & loaded:
            del required[name]
            owner, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(owner), attr, model.get_parameter(source))
    missing = [
        key
        for keys, fused in required.values()
        if fused not in loaded
        for key in keys
        if key not in loaded
    ]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 8 else ""
        )
        raise WeightLoadError(f"checkpoint {path} is missing weights: {shown}")
    extra = [k for k in unexpected if not _is_ignorable(k, config)]
    if extra:
        logger.warning("ignoring %d unexpected checkpoint tensors, e.g. %s", len(extra), extra[:5])


def _checkpoint_keys(name: str, config: ModelConfig) -> tuple[list[tuple[str, dict]], str | None]:
    """Parameter name -> ([(checkpoint key, weight_loader kwargs)], fused alternative key)."""
    hf = _hf_name(name, config)
    if hf.endswith("experts.gate_up_proj") or hf.endswith("experts.down_proj"):
        base, proj = hf.rsplit(".", 1)
        projs = ["gate_proj", "up_proj"] if proj == "gate_up_proj" else ["down_proj"]
        keys = [
            (
                f"{base}.{e}.{p}.weight",
                {"expert_id": e} | ({"shard_id": s} if len(projs) > 1 else {}),
            )
            for e in range(config.n_routed_experts or 0)
            for s, p in enumerate(projs)
        ]
        return keys, hf
    if hf.endswith("gate_up_proj.weight"):
        base = hf.removesuffix("gate_up_proj.weight")
        return [
            (f"{base}gate_proj.weight", {"shard_id": 0}),
            (f"{base}up_proj.weight", {"shard_id": 1}),
        ], None
    return [(hf, {})], None


def _hf_name(name: str, config: ModelConfig) -> str:
    if not name.startswith("mtp."):
        return name
    layer = f"model.layers.{config.num_hidden_layers}."
    rest = name.removeprefix("mtp.")
    return layer + rest.removeprefix("block.")


def load_kv_scales(model_config: ModelConfig, path: str | Path) -> list[float] | None:
    """Per-layer latent KV-cache scales from the checkpoint, or None if it has none.
    Layers without one get 1.0."""
    path = Path(path)
    found: dict[int, float] = {}
    for key, (file, _) in _index_checkpoint(path).items():
        m = _KV_SCALE_KEY.match(key)
        if m and int(m.group(1)) < model_config.num_hidden_layers:
            with safe_open(file, framework="pt", device="cpu") as f:
                value = float(f.get_tensor(key).float().reshape(-1)[0])
            if not value > 0:
                raise WeightLoadError(f"{key}: KV scale must be positive, got {value}")
            found[int(m.group(1))] = value
    if not found:
        return None
    return [found.get(i, 1.0) for i in range(model_config.num_hidden_layers)]


def _is_ignorable(key: str, config: ModelConfig) -> bool:
    """Tensors we knowingly skip: rotary caches, KV-cache scales (read by `load_kv_scales`), and
    layers past the ones we build (extra MTP depths, or MTP weights when the config has none)."""
    if key.endswith("rotary_emb.inv_freq") or _KV_SCALE_KEY.match(key):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= config.num_hidden_layers


def _index_checkpoint(path: Path) -> dict[str, tuple[Path, str]]:
    """key -> (file, safetensors dtype string), from the headers only. Rejects FP8 checkpoints."""
    files = _checkpoint_files(path)
    index: dict[str, tuple[Path, str]] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118
                index[key] = (file, f.get_slice(key).get_dtype())
    fp8 = [k for k, (_, dt) in index.items() if dt.startswith("F8") or k.endswith("_scale_inv")]
    if fp8:
        raise WeightLoadError(
            f"{path}: FP8 block-quantized weights are not supported (e.g. {fp8[0]} is "
            f"{index[fp8[0]][1]}); convert the checkpoint to bf16 first (DeepSeek-V3's "
            "inference/fp8_cast_bf16.py does this)"
        )
    return index


def _checkpoint_files(path: Path) -> list[Path]:
    if not path.is_dir():
        raise WeightLoadError(f"model path {str(path)!r} is not a directory")
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        with open(index_file) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [p.name for p in files if not p.is_file()]
        if absent:
            raise WeightLoadError(f"{index_file.name} lists shards that do not exist: {absent}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {str(path)!r}")
    return files
