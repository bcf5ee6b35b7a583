"""Request and response bodies of the HTTP API (pydantic), following OpenAI's and vLLM's shapes.

Field constraints here are the ones that need no model: types, ranges and sizes. What depends on
the model (token ids within the vocabulary, prompt + max_tokens within the context) is checked
by the engine when a request is added.

Nothing is silently ignored. Every field of OpenAI's completions and chat schemas is declared:
it is honoured, or refused with a 400 naming it when set to anything but its no-op value
(`unsupported()` of each request says which; the endpoints refuse the first). A field that is
not declared at all (a typo, another server's extension) is refused too (`extra="forbid"`: the
400 names it), so a client never gets something other than what it asked for without knowing.
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

from mlaserve.sampling_params import MAX_TEMPERATURE, StructuredOutputsParams

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
    "PromptLogprob",
    "ResponseFormat",
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
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description="Not supported; must not be true.")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


# A set field whose value is not supported: (field, why). The endpoint refuses the first.
Unsupported = list[tuple[str, str]]


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
    return_spec_stats: bool = Field(
        False, description="Add speculative-decoding draft/accept counts to `usage`."
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


class TextContentPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    """A message as the chat template sees it: `name`, an assistant's `tool_calls` and a tool
    result's `tool_call_id` reach the template (which renders them or not, as the model's own
    template does). `refusal`, `audio` and `function_call` are refused when set."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = Field(None, description="Not supported.")
    audio: dict[str, Any] | None = Field(None, description="Not supported.")
    function_call: dict[str, Any] | None = Field(None, description="Not supported; use tool_calls.")

    def template_dict(self) -> dict[str, Any]:
        """The message for the chat template (developer -> system, content parts joined)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

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
    # Chat-template controls (vLLM's names and meaning).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. thinking=true)."
    )
    # OpenAI fields with nothing behind them here: refused when set to anything but a no-op.
    audio: dict[str, Any] | None = Field(None, description="Not supported.")
    modalities: list[str] | None = Field(None, description="Only ['text'].")
    prediction: dict[str, Any] | None = Field(None, description="Not supported.")
    reasoning_effort: str | None = Field(None, description="Not supported.")
    verbosity: str | None = Field(None, description="Not supported.")
    web_search_options: dict[str, Any] | None = Field(None, description="Not supported.")
    functions: list[Any] | None = Field(None, description="Not supported; use tools.")
    function_call: Any | None = Field(None, description="Not supported; use tool_choice.")
    store: bool | None = Field(None, description="Only false: nothing is stored.")
    metadata: dict[str, str] | None = Field(None, description="Not supported (needs store).")
    service_tier: str | None = Field(None, description="Only 'auto' or 'default'.")
    moderation: Any | None = Field(None, description="Not supported.")
    # Identification and prompt-cache hints: no effect on the output by definition (this
    # server keeps no prompt cache to route or retain).
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None

    def unsupported(self) -> Unsupported:
        out = super().unsupported()
        for name in ("audio", "prediction", "reasoning_effort", "verbosity", "moderation",
                     "web_search_options", "functions", "function_call", "metadata"):  # fmt: skip
            if getattr(self, name) is not None:
                out.append((name, "is not supported"))
        if self.modalities not in (None, ["text"]):
            out.append(("modalities", "only supports ['text']"))
        if self.store:
            out.append(("store", "is not supported: this server stores no completions"))
        if self.service_tier not in (None, "auto", "default"):
            out.append(("service_tier", "only supports 'auto' and 'default'"))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "requires logprobs=true"))
        if self.continue_final_message and self.add_generation_prompt:
            out.append(
                ("continue_final_message", "cannot be combined with add_generation_prompt=true")
            )
        if self.continue_final_message and self.messages[-1].role != "assistant":
            out.append(("continue_final_message", "needs an assistant message last"))
        reserved = RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {})
        if reserved:
            out.append(("chat_template_kwargs", f"must not set {sorted(reserved)}"))
        for i, m in enumerate(self.messages):
            for name in ("refusal", "audio", "function_call"):
                if getattr(m, name) is not None:
                    out.append((f"messages.{i}.{name}", "is not supported"))
        return out


# Template arguments the server sets itself (the request's own fields, or how it renders).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tokenize", "return_dict", "return_tensors", "chat_template",
    "add_generation_prompt", "continue_final_message", "tools", "documents",
})  # fmt: skip


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
class SpecStatsInfo(BaseModel):
    """Speculative decoding for one HTTP request (all its choices): draft tokens verified and
    accepted."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    spec_stats: SpecStatsInfo | None = None  # only with "return_spec_stats": true

    @model_serializer(mode="wrap")
    def _omit_absent_spec_stats(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        if data.get("spec_stats") is None:
            data.pop("spec_stats", None)
        return data


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one entry of `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt token: None for the first, else {token_id: PromptLogprob} (the token and top-k).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop or length")
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
    prompt_logprobs: PromptLogprobs | None = None  # vLLM: of the rendered prompt, when asked

    @model_serializer(mode="wrap")
    def _omit_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("prompt_logprobs") is None:
            out.pop("prompt_logprobs", None)
        return out


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
