"""The bodies of /v1/chat/completions: messages, tools, and the response, whole or streamed."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from mlaserve.service.protocol_common import (
    MAX_LOGPROBS,
    STOP_REASON_DOC,
    PromptLogprobs,
    RequestBody,
    SamplingRequest,
    Text,
    Unsupported,
    UsageInfo,
)

__all__ = [
    "RESERVED_TEMPLATE_KWARGS",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatLogprobs",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "ChatTool",
    "DeltaFunctionCall",
    "DeltaToolCall",
    "FunctionCall",
    "FunctionDefinition",
    "NamedFunction",
    "NamedToolChoice",
    "TextContentPart",
    "ToolCall",
    "TopLogprob",
]


class TextContentPart(RequestBody):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestBody):
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


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
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
        fmt = self.response_format.type if self.response_format is not None else "text"
        if self.forces_tool_call and (fmt != "text" or self.guided_json is not None):
            out.append(("tool_choice", "'required' or a named function cannot be combined with "
                        "response_format or guided_json (the call has its own grammar)"))  # fmt: skip
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

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice 'required' or a named function: the output is grammar-constrained to
        tool calls (the server's grammar replaces response_format / guided_json)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def structured_output_field(self) -> str:
        # The field a refused grammar (no xgrammar, speculative decoding) is blamed on.
        return "tool_choice" if self.forces_tool_call else super().structured_output_field


# Template arguments the server sets itself (the request's own fields, or how it renders).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tokenize", "return_dict", "return_tensors", "chat_template",
    "add_generation_prompt", "continue_final_message", "tools", "documents",
})  # fmt: skip


# ----- responses -----
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
    stop_reason: int | str | None = Field(None, description=STOP_REASON_DOC)


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
    stop_reason: int | str | None = Field(None, description=STOP_REASON_DOC)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
