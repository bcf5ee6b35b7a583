"""Speculative decoding settings, in vLLM's `speculative_config` shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlaserve.config.error import ConfigError

__all__ = ["DEFAULT_NUM_SPECULATIVE_TOKENS", "SPECULATIVE_METHODS", "SpeculativeConfig"]

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
