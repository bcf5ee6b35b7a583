"""Per-request sampling parameters, with vLLM's names and defaults, validated at construction."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_LOGPROBS",
    "MAX_TEMPERATURE",
    "SAMPLING_EPS",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingParamsError",
    "StructuredOutputsParams",
]

# Most alternatives a request may ask for per token (vLLM's default `--max-logprobs`).
MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy (vLLM's `_SAMPLING_EPS`): dividing logits by a
# tiny temperature only overflows, and the result is argmax anyway.
SAMPLING_EPS = 1e-5
# Highest temperature accepted. The sampler divides float32 logits by it: from ~3.4e38 up the
# temperature itself is inf in float32, the min_tokens ban (-inf / inf) becomes NaN and argmax
# picks that NaN. Long before that the distribution is uniform to float32 precision, so a
# modest bound loses nothing (OpenAI accepts [0, 2]).
MAX_TEMPERATURE = 100.0


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries (vLLM's names).

    CUMULATIVE: everything so far (text, token ids, logprobs), copied every step: O(length) host
    work per step, kept as the offline default for vLLM compatibility. DELTA: only what this
    step added; the caller assembles the whole output (O(new tokens) per step). FINAL_ONLY: one
    cumulative output when the request finishes, nothing before.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. The message starts with the field name."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names): `json`, a JSON schema (dict or JSON
    text), `json_object`, any JSON object, or `structural_tag`, an xgrammar structural tag (JSON
    text; the server's forced tool calls). Decoded through xgrammar's token bitmasks
    (engine/grammar.py)."""

    json: str | dict | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = (self.json is not None) + bool(self.json_object) + (self.structural_tag is not None)
        if given != 1:
            raise SamplingParamsError(
                "structured_outputs: give exactly one of json (a schema), json_object=True and "
                "structural_tag"
            )
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            raise SamplingParamsError("structured_outputs: structural_tag must be JSON text")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise SamplingParamsError("structured_outputs: json must be a schema dict or string")


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt; the engine fans out into n requests (see `for_sample`)
    max_tokens: int | None = 16  # None = up to max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 = disabled (-1 is normalised to 0)
    min_p: float = 0.0  # [0, 1], relative to the most likely token's probability
    seed: int | None = None  # None = the engine picks one
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; 0 = chosen token only; k = chosen + top-k
    # Per prompt token (the first gets None): None = none; 0 = the prompt token only; k = it +
    # top-k. Computed by the prefill forward itself (engine/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0  # > 0; prompt + output tokens (vLLM semantics)
    frequency_penalty: float = 0.0  # [-2, 2]; output tokens, scaled by count
    presence_penalty: float = 0.0  # [-2, 2]; output tokens, once each
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, low=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0, high=MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        if self.top_k == -1:
            self.top_k = 0
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed)
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise SamplingParamsError(
                "structured_outputs: must be a StructuredOutputsParams, "
                f"got {self.structured_outputs!r}"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise SamplingParamsError(
                f"output_kind: must be a RequestOutputKind, got {self.output_kind!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        """`stop` with its normalised type (for type checkers)."""
        return self.stop if isinstance(self.stop, list) else []

    @property
    def stop_ids(self) -> list[int]:
        """`stop_token_ids` with its normalised type (for type checkers)."""
        return self.stop_token_ids or []

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed (lists are copied, never shared)."""
        changes.setdefault("stop", list(self.stop_strings))
        changes.setdefault("stop_token_ids", list(self.stop_ids))
        return dataclasses.replace(self, **changes)

    def clone(self) -> SamplingParams:
        return self.replace()

    def for_sample(self, index: int) -> SamplingParams:
        """Params of completion `index` of an `n > 1` request: n = 1 and, if seeded, seed + index,
        so each completion is reproducible on its own and the n completions differ."""
        if not 0 <= index < self.n:
            raise ValueError(f"index: must be in [0, {self.n}), got {index}")
        seed = None if self.seed is None else self.seed + index
        return self.replace(n=1, seed=seed)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids index device tensors, so out-of-range ones must be refused at intake
        (on CUDA they would surface later as an asynchronous device assert)."""
        bad = [t for t in self.stop_ids if t >= vocab_size]
        if bad:
            raise SamplingParamsError(
                f"stop_token_ids: ids must be < vocab size {vocab_size}, got {bad}"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingParamsError(f"{name}: must be an integer, got {value!r}")
    if low is not None and value < low:
        raise SamplingParamsError(f"{name}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise SamplingParamsError(f"{name}: must be <= {high}, got {value}")


def _check_float(
    name: str, value: object, low: float, high: float | None = None, low_open: bool = False
) -> None:
    if not (isinstance(value, int | float) and not isinstance(value, bool)):
        raise SamplingParamsError(f"{name}: must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise SamplingParamsError(f"{name}: must be finite, got {value}")
    if low_open and value <= low:
        raise SamplingParamsError(f"{name}: must be > {low}, got {value}")
    if value < low:
        raise SamplingParamsError(f"{name}: must be >= {low}, got {value}")
    if high is not None and value > high:
        raise SamplingParamsError(f"{name}: must be <= {high}, got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SamplingParamsError(f"{name}: must be a boolean, got {value!r}")


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise SamplingParamsError(f"stop: must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise SamplingParamsError("stop: stop strings must be non-empty")
    return list(stop)


def _normalise_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list | tuple) or not all(_is_int(t) for t in ids):
        raise SamplingParamsError(f"stop_token_ids: must be a list of integers, got {ids!r}")
    if any(t < 0 for t in ids):
        raise SamplingParamsError(f"stop_token_ids: ids must be >= 0, got {list(ids)}")
    return list(ids)
