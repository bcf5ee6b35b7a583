"""Typed, validated configuration: the model's hyper-parameters and the engine's knobs.

`ModelConfig` is parsed from a checkpoint's `config.json` and keeps the DeepSeek paper's names
(`kv_lora_rank`, `qk_rope_head_dim`, ...). `EngineConfig` holds what an operator chooses. Both are
frozen dataclasses validated when built; a bad value raises `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlaserve.kernels_adapter.registry import available_backends

__all__ = [
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "QuantizationConfig",
    "SpeculativeConfig",
    "default_model_path",
    "resolve_torch_dtype",
]

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8")
MODEL_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def default_model_path() -> Path:
    """The small DeepSeek-V3-architecture model shipped inside the package."""
    return Path(__file__).parent / "assets" / "default-model"


def resolve_torch_dtype(name: str) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ConfigError(f"dtype: unknown dtype {name!r}; expected one of {sorted(table)}")
    return table[name]


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
class QuantizationConfig:
    """FP8 block quantization of the published DeepSeek-V3 / R1 / Kimi-K2 checkpoints.

    `config.json` says `quantization_config: {quant_method: "fp8", fmt: "e4m3",
    weight_block_size: [128, 128], activation_scheme: "dynamic"}`: every quantized linear weight
    W [N, K] is stored as float8_e4m3fn with one fp32 `weight_scale_inv` per 128 x 128 block,
    shape [ceil(N/128), ceil(K/128)], and W = W_fp8 * scale (the `_inv` is DeepSeek's name; it is
    multiplied). Activations are quantized at run time per token and 128-wide group.
    """

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"

    def __post_init__(self) -> None:
        if self.quant_method != "fp8":
            raise ConfigError(
                f"quantization_config.quant_method: only 'fp8' (block-quantized, as DeepSeek-V3 "
                f"publishes it) is supported, got {self.quant_method!r}"
            )
        if self.fmt != "e4m3":
            raise ConfigError(
                f"quantization_config.fmt: only 'e4m3' is supported, got {self.fmt!r}"
            )
        if tuple(self.weight_block_size) != (128, 128):
            raise ConfigError(
                "quantization_config.weight_block_size: only [128, 128] is supported, got "
                f"{list(self.weight_block_size)}"
            )
        if self.activation_scheme != "dynamic":
            raise ConfigError(
                "quantization_config.activation_scheme: only 'dynamic' (per-token 1x128 groups "
                f"quantized at run time) is supported, got {self.activation_scheme!r}"
            )

    @property
    def block_n(self) -> int:
        return self.weight_block_size[0]

    @property
    def block_k(self) -> int:
        return self.weight_block_size[1]

    @classmethod
    def from_dict(cls, d: Any) -> QuantizationConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"quantization_config: expected an object, got {d!r}")
        for key in _QUANT_REQUIRED:
            if key not in d:
                raise ConfigError(f"quantization_config.{key}: missing (required for FP8 blocks)")
        for key, value in d.items():
            if key in _QUANT_REQUIRED:
                continue
            if key in _QUANT_IGNORED_IF_EMPTY and not value:
                continue  # re-exports write e.g. `modules_to_not_convert: null`
            raise ConfigError(
                f"quantization_config.{key}: not supported (value {value!r}); supported keys "
                f"are {list(_QUANT_REQUIRED)}"
            )
        block = d["weight_block_size"]
        if not isinstance(block, list | tuple) or len(block) != 2:
            raise ConfigError(
                f"quantization_config.weight_block_size: expected [128, 128], got {block!r}"
            )
        return cls(
            quant_method=str(d["quant_method"]),
            fmt=str(d["fmt"]),
            weight_block_size=(int(block[0]), int(block[1])),
            activation_scheme=str(d["activation_scheme"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` form (what a converted checkpoint writes)."""
        return {
            "quant_method": self.quant_method,
            "fmt": self.fmt,
            "weight_block_size": list(self.weight_block_size),
            "activation_scheme": self.activation_scheme,
        }


_QUANT_REQUIRED = ("quant_method", "fmt", "weight_block_size", "activation_scheme")
# Keys some re-exports carry with an empty value; any non-empty value is a feature we lack.
_QUANT_IGNORED_IF_EMPTY = ("modules_to_not_convert", "ignored_layers")


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

    # ----- derived -----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values stored per token per layer: the latent plus the shared rope key (512 + 64)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 (DeepSeek's correction)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = _yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts is not None
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
        )

    # ----- parsing -----
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model: no config.json in {str(path)!r}")
        with open(config_file) as f:
            return cls.from_dict(json.load(f))

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
        is_v3 = model_type == "deepseek_v3"
        rope_theta, rope_scaling = _parse_rope(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
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


SPECULATIVE_METHODS = ("mtp",)
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` shape: `{"method": "mtp", "num_speculative_tokens": k}`.

    `num_speculative_tokens` None means "the default for this model" (3 with MTP weights); the
    bound k + 1 <= the attention backend's `max_uniform_q_len` is checked by the model runner,
    which knows the backend."""

    method: str = "mtp"
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config.method: expected one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(
                f"speculative_config.num_speculative_tokens: must be an integer >= 1, got {k!r}"
            )

    @classmethod
    def from_dict(cls, d: Any) -> SpeculativeConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config: expected a JSON object, got {d!r}")
        unknown = set(d) - {"method", "num_speculative_tokens"}
        if unknown:
            raise ConfigError(
                f"speculative_config: unknown key(s) {sorted(unknown)}; expected 'method', "
                "'num_speculative_tokens'"
            )
        return cls(**d)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS


@dataclass(frozen=True)
class EngineConfig:
    """What the operator chooses. Every field can also come from the CLI / `MLASERVE_*` env."""

    model: str | None = None  # checkpoint folder; None = the default model shipped in the package
    tokenizer: str | None = None  # defaults to `model`
    device: str = "auto"  # "auto" = cuda if available else cpu
    dtype: str = "auto"  # "auto" = the checkpoint's dtype on cuda, float32 on cpu
    kv_cache_dtype: str | None = None  # None = fp8_e4m3 on cuda, "auto" (= dtype) on cpu
    page_size: int = 64
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None = min(model max_position_embeddings, 8192)
    max_num_batched_tokens: int = 2048
    kv_cache_memory_fraction: float = 0.85  # of free GPU memory after the weights are loaded
    # vLLM's meaning: the share of the GPU's total memory for weights + KV cache + graphs. When
    # set, the KV cache gets kv_cache_memory_fraction of (this share - what the weights took).
    gpu_memory_utilization: float | None = None
    num_pages: int | None = None  # explicit KV pool size; overrides the fraction
    attention_backend: str = "auto"
    # CUDA graphs for decode steps: None = on when the device is CUDA.
    cuda_graph: bool | None = None
    # Captured batch sizes; None = 1 2 4 8 12 16 24 32, then steps of 16 up to max_num_seqs.
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # Piecewise CUDA graphs for EXTEND (prefill) batches: everything but attention replayed per
    # token bucket. None = on with CUDA graphs.
    piecewise_cuda_graph: bool | None = None
    # The largest captured token bucket; None = min(max_num_batched_tokens, 4096).
    piecewise_cuda_graph_max_tokens: int | None = None
    # Overlap scheduling (SGLang's overlap scheduler, vLLM's async scheduling): the next step is
    # scheduled and launched before the previous one's tokens are read back, so the host's
    # per-step work runs while the GPU computes. None = on when the device is CUDA. Steps that
    # need the previous tokens on the host first (speculation, structured output, logprobs)
    # run synchronously either way.
    overlap_schedule: bool | None = None
    seed: int = 0
    served_model_name: str | None = None
    # Speculative decoding, vLLM's shape: {"method": "mtp", "num_speculative_tokens": k}.
    speculative_config: dict | None = field(default=None, hash=False)
    # Shorthand for {"method": "mtp", "num_speculative_tokens": k}.
    num_speculative_tokens: int | None = None
    # Hard cap: decode steps with more requests than this never speculate (the cost policy
    # decides below it).
    speculative_disable_batch_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: expected 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype: expected one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size: must be a power of two >= 1, got {self.page_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(
                f"kv_cache_memory_fraction: must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.attention_backend not in ("auto", *available_backends()):
            raise ConfigError(
                f"attention_backend: unknown backend {self.attention_backend!r}; expected 'auto' "
                f"or one of {available_backends()}"
            )
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages: must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.cuda_graph_batch_sizes is not None:
            sizes = self.cuda_graph_batch_sizes
            if isinstance(sizes, str):  # "1,2,4" from a flag or an environment variable
                sizes = [s for s in sizes.replace(" ", ",").split(",") if s]
            try:
                sizes = tuple(sorted({int(s) for s in sizes}))
            except (TypeError, ValueError):
                raise ConfigError(
                    f"cuda_graph_batch_sizes: expected integers, got {self.cuda_graph_batch_sizes!r}"
                ) from None
            if not sizes or sizes[0] < 1 or sizes[-1] > self.max_num_seqs:
                raise ConfigError(
                    f"cuda_graph_batch_sizes: need sizes in [1, max_num_seqs={self.max_num_seqs}], "
                    f"got {list(sizes)}"
                )
            object.__setattr__(self, "cuda_graph_batch_sizes", sizes)
        pw = self.piecewise_cuda_graph_max_tokens
        if pw is not None and (
            isinstance(pw, bool)
            or not isinstance(pw, int)
            or not 1 <= pw <= self.max_num_batched_tokens
        ):
            raise ConfigError(
                "piecewise_cuda_graph_max_tokens: need an integer in [1, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}], got {pw!r}"
            )
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"num_speculative_tokens: must be an integer >= 1, got {k!r}")
        cap = self.speculative_disable_batch_size
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ConfigError(
                f"speculative_disable_batch_size: must be an integer >= 1, got {cap!r}"
            )
        spec = self.speculative
        if k is not None and spec is not None and spec.num_speculative_tokens != k:
            raise ConfigError(
                f"num_speculative_tokens: {k} contradicts speculative_config."
                f"num_speculative_tokens {spec.num_speculative_tokens}"
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative decoding settings, or None when speculation is off."""
        if self.speculative_config is None:
            if self.num_speculative_tokens is None:
                return None
            return SpeculativeConfig(num_speculative_tokens=self.num_speculative_tokens)
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec.num_speculative_tokens is None and self.num_speculative_tokens is not None:
            spec = dataclasses.replace(spec, num_speculative_tokens=self.num_speculative_tokens)
        return spec

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past a decode's own token that one speculative step may write (verify
        writes k more, the draft chain up to k - 1 beyond the accepted ones): 2k; 0 when off."""
        spec = self.speculative
        return 0 if spec is None else 2 * spec.k

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    # ----- resolution against the machine and the model -----
    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else default_model_path()

    @property
    def tokenizer_path(self) -> Path:
        return Path(self.tokenizer) if self.tokenizer else self.model_path

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: 'cuda' was asked for but no CUDA device is available")
        return dev

    def resolved_cuda_graph(self) -> bool:
        device = self.resolved_device()
        if self.cuda_graph and device.type != "cuda":
            raise ConfigError(f"cuda_graph: CUDA graphs need a CUDA device, got {device}")
        return device.type == "cuda" if self.cuda_graph is None else self.cuda_graph

    def resolved_piecewise_cuda_graph_max_tokens(self) -> int:
        """The largest token bucket of EXTEND's piecewise CUDA graphs; 0 when they are off
        (asked off, or CUDA graphs off). Above 4096 tokens a prefill's GPU work already hides
        its host work, so the default stops there."""
        graphs = self.resolved_cuda_graph()
        if self.piecewise_cuda_graph and not graphs:
            raise ConfigError("piecewise_cuda_graph: needs CUDA graphs (cuda_graph is off)")
        if not (graphs if self.piecewise_cuda_graph is None else self.piecewise_cuda_graph):
            return 0
        if self.piecewise_cuda_graph_max_tokens is not None:
            return self.piecewise_cuda_graph_max_tokens
        return min(self.max_num_batched_tokens, 4096)

    def resolved_overlap_schedule(self) -> bool:
        """Overlap scheduling: as asked, else on with CUDA. With speculation it applies to the
        plain steps the policy chooses (no draft work) only: a speculative step reads the
        accepted tokens back before the next one can be scheduled."""
        if self.overlap_schedule is None:
            return self.resolved_device().type == "cuda"
        return self.overlap_schedule

    def resolved_cuda_graph_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes to capture, ascending (capture itself goes largest first)."""
        if self.cuda_graph_batch_sizes is not None:
            return self.cuda_graph_batch_sizes
        sizes = {1, 2, 4, 8, 12, 16, 24, 32, *range(48, self.max_num_seqs + 1, 16)}
        return tuple(sorted(s for s in sizes | {self.max_num_seqs} if s <= self.max_num_seqs))

    def resolved_dtype(self, model_config: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            return resolve_torch_dtype(self.dtype)
        if self.resolved_device().type == "cpu":
            return torch.float32
        name = model_config.torch_dtype
        if model_config.quantization is not None and name not in MODEL_DTYPES:
            name = "bfloat16"  # e.g. "float8_e4m3fn": FP8 block checkpoints compute in bf16
        dtype = resolve_torch_dtype(name)
        return torch.bfloat16 if dtype == torch.float32 else dtype

    def resolved_kv_cache_dtype(self, model_config: ModelConfig) -> torch.dtype:
        kind = self.kv_cache_dtype
        if kind is None:
            kind = "fp8_e4m3" if self.resolved_device().type == "cuda" else "auto"
        if kind in ("fp8", "fp8_e4m3"):
            return torch.float8_e4m3fn
        if kind in ("bf16", "bfloat16"):
            return torch.bfloat16
        return self.resolved_dtype(model_config)

    def resolved_max_model_len(self, model_config: ModelConfig) -> int:
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return min(limit, 8192)
        if self.max_model_len > limit and model_config.rope_scaling is None:
            raise ConfigError(
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        return self.max_model_len

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
