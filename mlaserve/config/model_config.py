"""The model's hyper-parameters, parsed from a checkpoint's `config.json`.

`ModelConfig` keeps the DeepSeek paper's names (`kv_lora_rank`, `qk_rope_head_dim`, ...); it is a
frozen dataclass validated when built, and a bad value raises `ConfigError` naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlaserve.config.error import ConfigError
from mlaserve.config.quantization_config import QuantizationConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "V3_ARCHITECTURE", "ModelConfig", "RopeScaling"]

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
# Kimi-K2 is DeepSeek-V3's architecture under its own name (Moonshot set "kimi_k2" so that
# engines can tell the two apart; its weights use V3's names and layout).
V3_ARCHITECTURE = ("deepseek_v3", "kimi_k2")


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (DeepSeek's `rope_scaling` / transformers' `rope_parameters`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None  # None: absent (transformers then uses mscale(factor))
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # explicit cos/sin scale; overrides the mscales
    truncate: bool = True  # floor/ceil the correction range, as DeepSeek does


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V2/V3 hyper-parameters with the paper's names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    # Multi-head latent attention.
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # Mixture of experts. `n_routed_experts=None` means every layer is dense.
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"  # "softmax" (V2) | "sigmoid" (V3)
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    # Everything else.
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # FP8 block-quantized weights (None: the checkpoint's weights are floating point).
    quantization: QuantizationConfig | None = None

    # ----- derived from the fields above, once, in __post_init__ (not arguments, compared or
    # shown; `dataclasses.replace` builds anew, so they follow) -----
    qk_head_dim: int = field(init=False, repr=False, compare=False)
    # Values stored per token per layer: the latent plus the shared rope key (512 + 64).
    kv_cache_dim: int = field(init=False, repr=False, compare=False)
    # 1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 (DeepSeek's correction).
    softmax_scale: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type: {self.model_type!r} is not supported; "
                f"expected one of {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim: must be even, got {self.qk_rope_head_dim}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"scoring_func: unsupported {self.scoring_func!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ConfigError(f"topk_method: unsupported {self.topk_method!r}")
        if self.n_routed_experts:
            if self.n_routed_experts % max(self.n_group, 1):
                raise ConfigError(
                    f"n_group: {self.n_group} does not divide n_routed_experts "
                    f"{self.n_routed_experts}"
                )
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise ConfigError(f"num_experts_per_tok: {self.num_experts_per_tok} out of range")
        self._derive()

    def _derive(self) -> None:
        """Sets the non-init fields (frozen, hence `object.__setattr__`)."""
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        scale = qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = _yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        object.__setattr__(self, "qk_head_dim", qk_head_dim)
        object.__setattr__(self, "kv_cache_dim", self.kv_lora_rank + self.qk_rope_head_dim)
        object.__setattr__(self, "softmax_scale", scale)

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    # ----- parsing -----
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """config.json, plus generation_config.json's `eos_token_id` where the folder has one:
        its ids end a generation too (as in vLLM). Kimi-K2's config.json names `[EOS]` while
        its chat turns end with `<|im_end|>`, which only generation_config.json names."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model: no config.json in {str(path)!r}")
        with open(config_file) as f:
            config = cls.from_dict(json.load(f))
        generation_file = Path(path) / "generation_config.json"
        if not generation_file.is_file():
            return config
        try:
            with open(generation_file) as f:
                generation = json.load(f)
        except ValueError as e:
            raise ConfigError(f"generation_config.json in {str(path)!r}: not JSON ({e})") from None
        extra = _token_ids(generation.get("eos_token_id") if isinstance(generation, dict) else None)
        eos = config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids)
        return config if eos == config.eos_token_ids else replace(config, eos_token_ids=eos)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type: {model_type!r} is not supported; expected one of "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        quant = d.get("quantization_config")
        quantization = QuantizationConfig.from_dict(quant) if quant is not None else None
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "kv_lora_rank",
            )
            if k not in d
        ]
        if missing:
            raise ConfigError(f"config.json: missing required keys {missing}")
        is_v3 = model_type in V3_ARCHITECTURE
        rope_theta, rope_scaling = _parse_rope(d)
        eos_ids = _token_ids(d.get("eos_token_id"))
        n_routed = d.get("n_routed_experts")
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d.get("intermediate_size", 4 * d["hidden_size"])),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(d.get("qk_rope_head_dim", 64)),
            v_head_dim=int(d.get("v_head_dim", 128)),
            n_routed_experts=int(n_routed) if n_routed else None,
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 1),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            scoring_func=d.get("scoring_func") or ("sigmoid" if is_v3 else "softmax"),
            topk_method=d.get("topk_method") or ("noaux_tc" if is_v3 else "greedy"),
            n_group=int(d.get("n_group") or 1),
            topk_group=int(d.get("topk_group") or 1),
            norm_topk_prob=bool(d.get("norm_topk_prob", is_v3)),
            hidden_act=d.get("hidden_act", "silu"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(d.get("rope_interleave", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(
                d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0
            ),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization=quantization,
        )


def _token_ids(value: Any) -> tuple[int, ...]:
    """An `eos_token_id` entry: one id, a list of them, or absent."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"eos_token_id: expected an int or a list of ints, got {value!r}")
    return tuple(values)


def _parse_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read rope settings from the published `rope_theta`/`rope_scaling` keys or from the
    `rope_parameters` key that newer transformers writes."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    src = params if params.get("rope_type", "default") != "default" else scaling
    kind = src.get("rope_type", src.get("type")) if src else None
    if not kind or kind == "default":
        return theta, None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"rope_scaling: only YaRN scaling is supported, got {kind!r}")
    if "original_max_position_embeddings" not in src:
        raise ConfigError("rope_scaling: YaRN needs key 'original_max_position_embeddings'")
    original = int(src["original_max_position_embeddings"])
    factor = src.get("factor")
    if factor is None:  # transformers' fallback: the context extension ratio
        factor = int(d.get("max_position_embeddings", original)) / original
    optional = {k: src.get(k) for k in ("mscale", "attention_factor")}
    return theta, RopeScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(src.get("beta_fast") or 32.0),
        beta_slow=float(src.get("beta_slow") or 1.0),
        mscale=None if optional["mscale"] is None else float(optional["mscale"]),
        mscale_all_dim=float(src.get("mscale_all_dim") or 0.0),
        attention_factor=(
            None if optional["attention_factor"] is None else float(optional["attention_factor"])
        ),
        truncate=bool(src.get("truncate", True)),
    )
