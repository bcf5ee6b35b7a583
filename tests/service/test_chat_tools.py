"""Tool calls and reasoning through the official `openai` client, streaming and not.

The servers serve the scripted checkpoint of scripted_model.py: its greedy replies are fixed
scripts written with DeepSeek's own marker tokens, so every field can be checked exactly.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.service.scripted_model import (
    ARGUMENTS,
    CALLS_BEGIN,
    CHAT_TEMPLATE_R1,
    make_scripted_checkpoint,
)
from tests.service.server_process import start_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory):
    return make_scripted_checkpoint(tmp_path_factory.mktemp("scripted"))


def _serve(path, log_dir, *args: str):
    proc = start_server(path, log_dir / "server.log", "--tool-call-parser", "deepseek_v3", *args)
    proc.wait_ready()
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
    return proc, client


@pytest.fixture(scope="module")
def v3(scripted, tmp_path_factory):
    """DeepSeek-V3 style: tool calls, no reasoning parser."""
    proc, client = _serve(scripted, tmp_path_factory.mktemp("v3"), "--enable-auto-tool-choice")
    yield client
    client.close()
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def r1(scripted, tmp_path_factory):
    """DeepSeek-R1 style: its template (through --chat-template FILE) and both parsers."""
    logs = tmp_path_factory.mktemp("r1")
    template = logs / "r1.jinja"
    template.write_text(CHAT_TEMPLATE_R1)
    proc, client = _serve(
        scripted, logs, "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1",
        "--chat-template", str(template),
    )  # fmt: skip
    yield client
    client.close()
    assert proc.stop() == 0


def _create(client: openai.OpenAI, **kwargs):
    kwargs = {"max_tokens": 40, "temperature": 0, **kwargs}
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, **kwargs
    )


def _collect(stream) -> dict:
    """Everything a streamed reply said, checking OpenAI's delta rules on the way."""
    got: dict = {"content": "", "reasoning": "", "calls": {}, "finish_reason": None}
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        got["content"] += delta.content or ""
        got["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.index not in got["calls"]:  # the first piece: id, type and name
                assert call.id.startswith("call_") and call.type == "function"
                got["calls"][call.index] = {"name": call.function.name, "pieces": []}
            else:  # then only pieces of the arguments
                assert call.id is None and call.function.name is None
            got["calls"][call.index]["pieces"].append(call.function.arguments or "")
        if choice.finish_reason is not None:
            got["finish_reason"] = choice.finish_reason
    return got


def test_auto_tool_call(v3) -> None:
    reply = _create(v3, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking the weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and call.function.arguments == ARGUMENTS
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_auto_tool_call_streamed(v3) -> None:
    got = _collect(_create(v3, tools=TOOLS, stream=True))
    assert got["content"] == "Checking the weather." and got["finish_reason"] == "tool_calls"
    assert list(got["calls"]) == [0] and got["calls"][0]["name"] == "get_weather"
    pieces = got["calls"][0]["pieces"]
    # Streamed as generated: more than one piece (3 tokens; a server running behind merges the
    # deltas that are ready into one chunk, as vLLM's does, so 2 pieces are as right as 3)
    assert "".join(pieces) == ARGUMENTS and len([p for p in pieces if p]) in (2, 3)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_forces_the_call(v3, stream: bool) -> None:
    reply = _create(v3, tools=TOOLS, tool_choice=NAMED, stream=stream)
    if stream:
        got = _collect(reply)
        assert got["content"] == "" and got["finish_reason"] == "stop"
        assert got["calls"][0]["name"] == "get_weather"
        assert "".join(got["calls"][0]["pieces"]) == ARGUMENTS
        return
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == ARGUMENTS


def test_required_tool_choice_forces_a_call(v3) -> None:
    choice = _create(v3, tools=TOOLS, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_tool_choice_none_leaves_the_text_alone(v3) -> None:
    with_tools = _create(v3, tools=TOOLS, tool_choice="none")
    choice = with_tools.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content.startswith("Checking the weather." + CALLS_BEGIN)
    # The tools reached the chat template (it lists their names): a longer prompt.
    without = _create(v3)
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens


def test_tool_requests_the_server_cannot_honour_are_400(v3, openai_client) -> None:
    cases = [
        (v3, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        (v3, {"tool_choice": "auto"}),  # no tools
        (openai_client, {"tools": TOOLS}),  # 'auto' without --enable-auto-tool-choice
        (openai_client, {"tools": TOOLS, "tool_choice": NAMED}),  # no --tool-call-parser
    ]
    for client, kwargs in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _create(client, **kwargs)
        assert e.value.body["param"] == "tool_choice", kwargs
    # tool_choice 'none' needs no parser: the tools only reach the template.
    reply = _create(openai_client, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert reply.choices[0].message.tool_calls is None


def test_reasoning_then_a_tool_call(r1) -> None:
    choice = _create(r1, tools=TOOLS).choices[0]
    assert choice.message.reasoning_content == "The user wants weather."
    assert choice.message.content == "\n\nLet me check."
    assert choice.message.tool_calls[0].function.arguments == ARGUMENTS
    assert choice.finish_reason == "tool_calls"


def test_reasoning_then_a_tool_call_streamed(r1) -> None:
    got = _collect(_create(r1, tools=TOOLS, stream=True))
    assert got["reasoning"] == "The user wants weather."
    assert got["content"] == "\n\nLet me check."
    assert "".join(got["calls"][0]["pieces"]) == ARGUMENTS
    assert got["finish_reason"] == "tool_calls"


def test_a_forced_call_closes_the_reasoning_first(r1) -> None:
    choice = _create(r1, tools=TOOLS, tool_choice=NAMED).choices[0]
    assert choice.message.reasoning_content is None and choice.message.content is None
    assert choice.message.tool_calls[0].function.arguments == ARGUMENTS
