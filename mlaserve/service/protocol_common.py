"""What /v1/completions and /v1/chat/completions share: field types and limits, the sampling
fields (`SamplingRequest`), usage and prompt logprobs. protocol.py says what the bodies promise.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from mlaserve.sampling_params import MAX_TEMPERATURE, StructuredOutputsParams
from mlaserve.service.request_limits import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_SEED,
    MAX_STOP_STRINGS,
)

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_PROMPT_TOKENS",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
    "STOP_REASON_DOC",
    "FiniteFloat",
    "PromptLogprob",
    "PromptLogprobs",
    "PromptTokensDetails",
    "RequestBody",
    "ResponseFormat",
    "SamplingRequest",
    "SpecStatsInfo",
    "StopList",
    "StopString",
    "StreamOptions",
    "Text",
    "TokenId",
    "Unsupported",
    "UsageInfo",
]

# A choice's `stop_reason` (vLLM's field), in completions and chat alike.
STOP_REASON_DOC = (
    "the stop string or stop token id that ended the choice (vLLM's field); null otherwise"
)


def _encodable(text: str) -> str:
    # JSON can carry lone surrogates ("\ud800"), which are not valid UTF-8 and would fail later.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"invalid UTF-8 text at position {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[str, Field(min_length=1), AfterValidator(_encodable)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class RequestBody(BaseModel):
    """A request body: a field it does not declare is refused (the 400 names it)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(RequestBody):
    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description="Not supported; must not be true.")


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


# A set field whose value is not supported: (field, why). The endpoint refuses the first.
Unsupported = list[tuple[str, str]]


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM extras included)."""

    model: str | None = Field(None, description="Served model name; defaults to the only one.")
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: FiniteFloat | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0 disables top-k.")
    min_p: FiniteFloat | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopString | StopList | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: FiniteFloat | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_spec_stats: bool = Field(
        False, description="Add speculative-decoding draft/accept counts to `usage`."
    )
    cache_salt: Annotated[str, Field(min_length=1), AfterValidator(_encodable)] | None = Field(
        None,
        description="vLLM: prefix caching shares cached KV pages only among requests of the "
        "same salt (tenant isolation).",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Not supported; must be empty.")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM: logprobs of the prompt tokens (+ top-k)."
    )
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema (grammar-constrained, xgrammar)."
    )
    guided_json: dict[str, Any] | str | None = Field(
        None, description="vLLM: a JSON schema the output must follow."
    )

    def unsupported(self) -> Unsupported:
        """The set fields this server does not support (shared by both endpoints)."""
        out: Unsupported = []
        if self.logit_bias:
            out.append(("logit_bias", "is not supported"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "requires stream=true"))
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            out.append(("stream_options.include_obfuscation", "is not supported"))
        fmt = self.response_format.type if self.response_format is not None else "text"
        if fmt != "text" and self.guided_json is not None:
            out.append(("guided_json", "cannot be combined with a response_format other than text"))
        if fmt == "json_schema":
            spec = self.response_format.json_schema  # type: ignore[union-attr]
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                out.append(("response_format.json_schema.schema", "must be a JSON schema object"))
        if self.prompt_logprobs is not None and self.stream:
            out.append(("prompt_logprobs", "is not available with stream=true (as in vLLM)"))
        return out

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar the output must follow: `response_format` json_object / json_schema
        (OpenAI), or `guided_json` (vLLM). Call after `unsupported()` found nothing."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            return StructuredOutputsParams(json=(fmt.json_schema or {})["schema"])
        if self.guided_json is not None:
            return StructuredOutputsParams(json=self.guided_json)
        return None

    @property
    def structured_output_field(self) -> str:
        return "guided_json" if self.guided_json is not None else "response_format"

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# ----- responses -----
class SpecStatsInfo(BaseModel):
    """Speculative decoding for one HTTP request (all its choices): draft tokens verified and
    accepted."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class PromptTokensDetails(BaseModel):
    """OpenAI's usage.prompt_tokens_details: prompt tokens the prefix cache held."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    spec_stats: SpecStatsInfo | None = None  # only with "return_spec_stats": true
    # With prefix caching on (absent when it is off).
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_spec_stats(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        for key in ("spec_stats", "prompt_tokens_details"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class PromptLogprob(BaseModel):
    """vLLM's shape of one entry of `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt token: None for the first, else {token_id: PromptLogprob} (the token and top-k).
PromptLogprobs = list[dict[int, PromptLogprob] | None]
