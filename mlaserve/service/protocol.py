"""Request and response bodies of the HTTP API (pydantic), following OpenAI's and vLLM's shapes.

Field constraints here are the ones that need no model: types, ranges and sizes. What depends on
the model (token ids within the vocabulary, prompt + max_tokens within the context) is checked
by the engine when a request is added.

Nothing is silently ignored. Every field of OpenAI's completions and chat schemas is declared:
it is honoured, or refused with a 400 naming it when set to anything but its no-op value
(`unsupported()` of each request says which; the endpoints refuse the first). A field that is
not declared at all (a typo, another server's extension) is refused too (`extra="forbid"`: the
400 names it), so a client never gets something other than what it asked for without knowing.

protocol_common.py       field types and limits, `SamplingRequest`, usage, prompt logprobs
protocol_completions.py  /v1/completions          protocol_chat.py  /v1/chat/completions
here                     /v1/models, /tokenize, /detokenize and error bodies; every name above
                         is importable from here
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from mlaserve.service.protocol_chat import (
    RESERVED_TEMPLATE_KWARGS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    TextContentPart,
    ToolCall,
    TopLogprob,
)
from mlaserve.service.protocol_common import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_SEED,
    MAX_STOP_STRINGS,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    RequestBody,
    ResponseFormat,
    SamplingRequest,
    SpecStatsInfo,
    StreamOptions,
    Text,
    TokenId,
    Unsupported,
    UsageInfo,
)
from mlaserve.service.protocol_completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_PROMPT_TOKENS",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
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
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "DeltaFunctionCall",
    "DeltaToolCall",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "FunctionCall",
    "FunctionDefinition",
    "ModelCard",
    "ModelList",
    "NamedFunction",
    "NamedToolChoice",
    "PromptLogprob",
    "PromptLogprobs",
    "PromptTokensDetails",
    "RequestBody",
    "ResponseFormat",
    "SamplingRequest",
    "SpecStatsInfo",
    "StreamOptions",
    "TextContentPart",
    "TokenizeRequest",
    "TokenizeResponse",
    "ToolCall",
    "TopLogprob",
    "Unsupported",
    "UsageInfo",
]


class TokenizeRequest(RequestBody):
    """Either `prompt` (tokenized as /v1/completions does) or `messages` (chat template)."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


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
