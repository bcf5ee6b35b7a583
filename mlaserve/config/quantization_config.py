"""FP8 block quantization settings, parsed from a checkpoint's `quantization_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlaserve.config.error import ConfigError

__all__ = ["QuantizationConfig"]


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
