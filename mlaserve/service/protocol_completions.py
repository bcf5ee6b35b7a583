"""The bodies of /v1/completions (OpenAI's legacy completions, with vLLM's extras)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
)

from mlaserve.service.protocol_common import (
    MAX_LOGPROBS,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    STOP_REASON_DOC,
    PromptLogprobs,
    SamplingRequest,
    Text,
    TokenId,
    Unsupported,
    UsageInfo,
)

__all__ = [
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "Prompt",
]


def _prompt_form(value: Any) -> str | None:
    """Which form a prompt has, from its first element: only that member of the union is
    validated. Trying every member (pydantic's default) builds one error per element of the
    forms that do not match: over a second for a body full of tiny prompts."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    if isinstance(first, str):
        return "list[str]"
    if isinstance(first, list):
        return "list[list[int]]"
    return "list[int]"


TokenIds = Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)]
# Tags are not identifiers, so error locations name the field alone ("prompt.3").
Prompt = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[list[Text], Field(max_length=MAX_PROMPTS), Tag("list[str]")]
    | Annotated[TokenIds, Tag("list[int]")]
    | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS), Tag("list[list[int]]")],
    Discriminator(
        _prompt_form,
        custom_error_type="invalid_prompt",
        custom_error_message="Input should be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids",
    ),
]


class CompletionRequest(SamplingRequest):
    prompt: Prompt = Field(
        description="A string, a list of strings, a list of token ids, or a list of such lists."
    )
    max_tokens: int | None = Field(
        None, ge=0, description="0 only with echo: score the prompt, generate nothing."
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(
        False, description="Return the prompt before the completion (and its logprobs)."
    )
    suffix: str | None = Field(None, description="Not supported.")
    best_of: int | None = Field(None, ge=1, description="Only best_of == n is supported.")

    def unsupported(self) -> Unsupported:
        out = super().unsupported()
        if self.suffix is not None:
            out.append(("suffix", "is not supported"))
        if self.best_of not in (None, self.n):
            out.append(("best_of", "must equal n"))
        if self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "0 requires echo=true (score the prompt only)"))
        return out


# ----- responses -----
class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop or length")
    stop_reason: int | str | None = Field(None, description=STOP_REASON_DOC)
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _omit_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("prompt_logprobs") is None:
            out.pop("prompt_logprobs", None)  # only when asked for, as in vLLM
        return out


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
