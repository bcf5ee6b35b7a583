"""Request bodies: what the schema accepts and refuses, and how a refusal is reported."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from mlaserve.service.errors import validation_error
from mlaserve.service.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionRequest,
    TokenizeRequest,
)


@pytest.mark.parametrize(
    "prompt",
    ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]], ""],
    ids=["str", "strs", "ids", "idss", "empty"],
)
def test_prompt_forms(prompt) -> None:
    assert CompletionRequest(prompt=prompt).prompt == prompt


def test_defaults_and_helpers() -> None:
    req = CompletionRequest(
        prompt="hi", stop="x", stream=True, stream_options={"include_usage": True}
    )
    assert req.n == 1 and req.max_tokens is None and req.temperature is None
    assert req.stop_list == ["x"] and req.include_usage_in_stream
    assert CompletionRequest(prompt="hi").stop_list == []
    with pytest.raises(ValidationError, match="unknown_field"):  # refused, never ignored
        CompletionRequest(prompt="hi", unknown_field=1)
    assert CompletionRequest(prompt="hi", max_tokens=0, echo=True).unsupported() == []
    assert CompletionRequest(prompt="hi", max_tokens=0).unsupported()[0][0] == "max_tokens"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "temperature": -0.1}, "temperature"),
        ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
        ({"prompt": "hi", "temperature": float("inf")}, "temperature"),
        ({"prompt": "hi", "top_p": 0.0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.01}, "top_p"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "best_of_n": 2}, "best_of_n"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "stop": ""}, "stop"),
        ({"prompt": "hi", "stop": ["a"] * 17}, "stop"),
        ({"prompt": "hi", "seed": -1}, "seed"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"prompt": [1, -1]}, "prompt"),
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_completion_request_refusals_name_the_field(body, param) -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
    bad = validation_error(RequestValidationError(errors))
    assert bad.status_code == 400 and bad.param == param
    assert bad.message.startswith(f"{param}: ")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 99}, "top_logprobs"),
    ],
)
def test_chat_request_refusals(body, param) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
    assert validation_error(RequestValidationError(errors)).param == param


def test_chat_content_parts_and_roles() -> None:
    req = ChatCompletionRequest(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert [m.text() for m in req.messages] == ["be brief", "ab", ""]


def test_json_and_body_errors() -> None:
    bad_json = RequestValidationError(
        [{"type": "json_invalid", "loc": ("body", 12), "msg": "JSON decode error"}]
    )
    err = validation_error(bad_json)
    assert err.code == "invalid_json" and err.param is None
    missing = RequestValidationError(
        [{"type": "missing", "loc": ("body",), "msg": "Field required"}]
    )
    assert validation_error(missing).message == "a JSON request body is required"


def test_chat_delta_carries_only_what_changed() -> None:
    chunk = ChatCompletionChunk(
        id="x",
        created=0,
        model="m",
        choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="a"))],
    )
    assert chunk.model_dump()["choices"][0]["delta"] == {"content": "a"}
    assert '"delta":{"content":"a"}' in chunk.model_dump_json()


def test_tokenize_request() -> None:
    assert TokenizeRequest(prompt="hi").add_special_tokens is True
    with pytest.raises(ValidationError):
        TokenizeRequest(messages=[])
