"""Forced tool calls (tool_choice 'required' or a named function) on the default model, sampled
at temperature 1 with 20 seeds: every choice is a call to a given tool whose arguments are JSON
valid against that tool's schema, streamed and not (issue 45); the same in Kimi-K2's format
(`--tool-call-parser kimi_k2`) with Kimi's call ids.

The default model writes Python, never DeepSeek's tool-call markers: without the grammar its
output would be no call at all, so these tests fail if the constraint does not hold. One
request with `n=20, seed=0` samples seeds 0..19 (choice i gets seed + i).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import openai
import pytest

from mlaserve.config import default_model_path
from tests.service.server_process import start_server

# In the test extra; a GPU host without it still collects the other service tests.
jsonschema_rs = pytest.importorskip("jsonschema_rs")

SEEDS = 20
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Lima", "Oslo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# A tool without `parameters` takes `{}` (vLLM's rule).
EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now."}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": EMPTY}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("forced-tools")
    proc = start_server(
        default_model_path(), logs / "server.log", "--tool-call-parser", "deepseek_v3",
        "--max-num-seqs", "32",
    )  # fmt: skip
    proc.wait_ready()
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()
    assert proc.stop() == 0


def _create(client: openai.OpenAI, **kwargs):
    kwargs = {"temperature": 1.0, "max_tokens": 400, **kwargs}
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, **kwargs
    )


def _sampled(client: openai.OpenAI, stream: bool, **kwargs) -> list[dict]:
    """Per seed 0..19: the choice's finish_reason and calls [(name, arguments)]; its content is
    empty (null when not streamed)."""
    per_request = SEEDS // 2  # n is at most 16
    choices = []
    for seed in (0, per_request):
        reply = _create(client, n=per_request, seed=seed, stream=stream, **kwargs)
        got = _streamed(reply) if stream else _whole(reply)
        assert sorted(got) == list(range(per_request))
        choices += [got[i] for i in range(per_request)]
    return choices


def _whole(reply, id_prefix: str = "call_") -> dict[int, dict]:
    got = {}
    for choice in reply.choices:
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert all(c.type == "function" and c.id.startswith(id_prefix) for c in calls)
        got[choice.index] = {
            "finish": choice.finish_reason,
            "calls": [(c.function.name, c.function.arguments) for c in calls],
            "ids": [c.id for c in calls],
        }
    return got


def _streamed(stream, id_prefix: str = "call_") -> dict[int, dict]:
    """Like `_whole`, checking vLLM's delta rules on the way: a call's first delta has its id,
    type, name and the arguments' start, later ones only pieces of the arguments."""
    got: dict[int, dict] = defaultdict(lambda: {"finish": None, "calls": {}})
    for chunk in stream:
        for choice in chunk.choices:
            out = got[choice.index]
            assert not choice.delta.content
            for call in choice.delta.tool_calls or []:
                if call.index not in out["calls"]:
                    assert call.id.startswith(id_prefix) and call.type == "function"
                    assert call.function.name and call.function.arguments is not None
                    out["calls"][call.index] = (call.function.name, "")
                else:
                    assert call.id is None and call.type is None and call.function.name is None
                name, arguments = out["calls"][call.index]
                out["calls"][call.index] = (name, arguments + (call.function.arguments or ""))
            if choice.finish_reason is not None:
                assert out["finish"] is None
                out["finish"] = choice.finish_reason
    return {i: {**out, "calls": list(out["calls"].values())} for i, out in got.items()}


def _check_call(name: str, arguments: str) -> str:
    """The arguments, parsed, validated against the tool's schema and written back sorted."""
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema_rs.validate(SCHEMAS[name], args)
    return json.dumps(args, sort_keys=True)


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_one_valid_call_per_choice(client, stream: bool) -> None:
    names = set()
    for choice in _sampled(client, stream, tool_choice="required", parallel_tool_calls=False):
        assert choice["finish"] == "tool_calls"
        ((name, arguments),) = choice["calls"]  # parallel_tool_calls=false: one call
        _check_call(name, arguments)
        names.add(name)
    assert names <= set(SCHEMAS)


@pytest.mark.parametrize(
    ("name", "stream"), [("get_weather", False), ("get_weather", True), ("get_time", False)]
)
def test_named_tool_gives_that_call_with_valid_arguments(client, name: str, stream: bool) -> None:
    named = {"type": "function", "function": {"name": name}}
    outputs = set()
    for choice in _sampled(client, stream, tool_choice=named):
        assert choice["finish"] == "stop"  # OpenAI's and vLLM's for a call forced by name
        ((got_name, arguments),) = choice["calls"]
        assert got_name == name
        outputs.add(_check_call(name, arguments))
    if name == "get_weather":
        assert len(outputs) > 1  # the seeds sampled different arguments


def test_forced_tool_choice_errors_name_the_field(client) -> None:
    cases = [
        {"tool_choice": "required", "tools": None},  # no tools
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
    ]
    model = client.models.list().data[0].id
    for case in cases:
        kwargs = {k: v for k, v in {"tools": TOOLS, **case}.items() if v is not None}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **kwargs)
        assert e.value.body["param"] == "tool_choice", case
    # The server keeps serving.
    assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2).choices


def test_forced_calls_under_speculation_are_refused_naming_tool_choice(
    checkpoint, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The speculative loop samples without the grammar mask: a forced call is refused there,
    as structured output is, and the server keeps serving."""
    logs = tmp_path_factory.mktemp("forced-tools-spec")
    proc = start_server(
        checkpoint("v3_mtp"), logs / "server.log", "--tool-call-parser", "deepseek_v3",
        "--num-speculative-tokens", "1",
    )  # fmt: skip
    proc.wait_ready()
    with openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=4
                )
            assert e.value.body["param"] == "tool_choice"
            assert "speculative decoding" in e.value.body["message"]
        assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert proc.stop() == 0


# ----- Kimi-K2's format (--tool-call-parser kimi_k2) -----
# The default model spells Kimi's markers with ordinary tokens (its tokenizer has none of
# them): without the grammar there would be no call at all, so these fail if the forced format
# or its parser breaks. Ids are Kimi's own, `functions.NAME:INDEX`.
KIMI_ID = re.compile(r"functions\.(\w+):\d+")


@pytest.fixture(scope="module")
def kimi_client(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("kimi-tools")
    proc = start_server(
        default_model_path(), logs / "server.log", "--tool-call-parser", "kimi_k2",
        "--enable-auto-tool-choice", "--max-num-seqs", "8",
    )  # fmt: skip
    proc.wait_ready()
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()
    assert proc.stop() == 0


def _kimi(client: openai.OpenAI, stream: bool, **kwargs) -> list[dict]:
    reply = _create(client, n=4, seed=0, stream=stream, max_tokens=300, **kwargs)
    got = _streamed(reply, "functions.") if stream else _whole(reply, "functions.")
    return [got[i] for i in range(4)]


@pytest.mark.parametrize("stream", [False, True])
def test_kimi_k2_call_forced_by_name_has_kimis_id(kimi_client, stream: bool) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in _kimi(kimi_client, stream, tool_choice=named):
        assert choice["finish"] == "stop"
        ((name, arguments),) = choice["calls"]
        assert name == "get_weather"
        _check_call(name, arguments)
        if not stream:
            assert choice["ids"] == ["functions.get_weather:0"]


def test_kimi_k2_required_gives_a_call_of_the_tools(kimi_client) -> None:
    for choice in _kimi(kimi_client, False, tool_choice="required", parallel_tool_calls=False):
        assert choice["finish"] == "tool_calls"
        ((name, arguments),) = choice["calls"]
        (call_id,) = choice["ids"]
        match = KIMI_ID.fullmatch(call_id)
        assert match and match.group(1) == name, call_id
        _check_call(name, arguments)


def test_kimi_k2_auto_without_markers_is_plain_content(kimi_client) -> None:
    reply = _create(kimi_client, max_tokens=8, temperature=0)  # tool_choice 'auto'
    message = reply.choices[0].message
    assert message.tool_calls is None and message.content
