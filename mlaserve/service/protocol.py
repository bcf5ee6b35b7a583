"""Request and response bodies of the HTTP API (pydantic), following OpenAI's and vLLM's shapes.

Field constraints here are the ones that need no model: types, ranges and sizes. What depends on
the model (token ids within the vocabulary, prompt + max_tokens within the context) is checked
by the engine when a request is added. Unknown fields are ignored, as OpenAI clients send
optional fields this server does not know; fields it knows but does not support are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
)

from mlaserve.sampling_params import MAX_TEMPERATURE

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTool",
    "CompletionRequest",
    "DeltaToolCall",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ModelCard",
    "ModelList",
    "NamedToolChoice",
    "SamplingRequest",
    "StreamOptions",
    "TokenizeRequest",
    "TokenizeResponse",
    "ToolCall",
    "UsageInfo",
]

MAX_N = 16  # choices per request
MAX_LOGPROBS = 20  # top-logprobs per token (OpenAI's limit)
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
# Hard ceilings of the schema (the server's own limits, `--max-prompts-per-request` and
# `--max-prompt-tokens-per-request`, may only be lower): what a body may hold at all.
MAX_PROMPTS = 2048
MAX_PROMPT_TOKENS = 1 << 20


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


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingRequest(_Body):
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
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Not supported; must be empty.")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


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
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="Not supported; must be false.")
    suffix: str | None = Field(None, description="Not supported.")
    best_of: int | None = Field(None, ge=1, description="Only best_of == n is supported.")


class TextContentPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = Field(
        None, max_length=128, description="Functions the model may call (--tool-call-parser)."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: 'auto' with tools, 'none' without."
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call.")
    response_format: dict[str, Any] | None = Field(None, description="Only type 'text'.")


class TokenizeRequest(_Body):
    """Either `prompt` (tokenized as /v1/completions does) or `messages` (chat template)."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


# ----- responses -----
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length or tool_calls")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class _Delta(BaseModel):
    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: the role once, then content; a tool call's
        # id and name once, then pieces of its arguments.
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Delta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Delta):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(_Delta):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length or tool_calls")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlaserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
