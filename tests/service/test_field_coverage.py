"""Every field of the OpenAI completions and chat schemas (as the installed `openai` SDK defines
them), and every vLLM extension this server declares: honoured, with a behavioural check, or
refused with a 400 naming it. Nothing is silently ignored.

Each row sends the baseline request (greedy, a few tokens) plus one field and checks the effect
against the baseline. The schemas' field lists come from the SDK, so a field OpenAI adds makes
`test_every_field_has_a_row` fail until it gets a row here (and a decision in protocol.py).

The chat rows run against a server whose chat template renders tool calls, tool results and a
`system_note` template variable, so template controls and tool-call history are observable in
the rendered prompt (returned by `prompt_logprobs`, token by token).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai.types as openai_types
import openai.types.chat as openai_chat
import pytest
import torch

from tests.checkpoints import make_reference_model
from tests.service.server_process import ServerProcess, start_server

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if system_note is defined %}<|system|>{{ system_note }}{{ eos_token }}"
    "{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|assistant|>"
    "{% for c in m['tool_calls'] %}<call>{{ c['function']['name'] }}"
    "({{ c['function']['arguments'] }})</call>{% endfor %}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['tool_call_id'] }}: {{ m['content'] }}"
    "{{ eos_token }}{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

Send = Callable[[dict[str, Any]], Any]  # extra fields -> response JSON (200 asserted)
Check = Callable[[Send, dict, dict], None]  # (send, baseline, response)


class Refused:
    def __init__(self, param: str) -> None:
        self.param = param


# ----- servers and helpers -----
@pytest.fixture(scope="module")
def chat_server(model_dir, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tool-template")
    path = Path(shutil.copytree(model_dir, root / "model"))
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    proc = start_server(path, root / "server.log", "--page-size", "16")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def post(server: ServerProcess, path: str, body: dict) -> Any:
    r = server.post(path, json=body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return r.json()


def text(resp: dict) -> str:
    c = resp["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


def same(_: Send, base: dict, resp: dict) -> None:
    """For fields that by definition do not change the output (identifiers, hints, no-ops)."""
    assert text(resp) == text(base)
    assert resp["usage"] == base["usage"]


def penalised(field: str) -> tuple[dict, Check]:
    """A penalty changes the greedy path once tokens repeat: 64 tokens of the tiny model do."""

    def check(send: Send, base: dict, resp: dict) -> None:
        assert text(resp) != text(send({"max_tokens": 64}))

    return {field: 2.0, "max_tokens": 64}, check


def tokens(n: int) -> Check:
    def check(_: Send, base: dict, resp: dict) -> None:
        assert resp["usage"]["completion_tokens"] == n
        assert resp["choices"][0]["finish_reason"] == "length"

    return check


def greedy_equal(_: Send, base: dict, resp: dict) -> None:
    assert text(resp) == text(base)  # sampled at temperature 1, yet the filter left one token


def num_choices(n: int) -> Check:
    def check(_: Send, base: dict, resp: dict) -> None:
        assert sorted(c["index"] for c in resp["choices"]) == list(range(n))

    return check


def seeded(send: Send, base: dict, resp: dict) -> None:
    again = send({"temperature": 1.5, "seed": 5})
    other = send({"temperature": 1.5, "seed": 6})
    assert text(again) == text(resp) and text(other) != text(resp)


def hot(send: Send, base: dict, resp: dict) -> None:
    assert text(resp) != text(base)  # temperature 2 with a seed: not the greedy path


def streamed(_: Send, base: dict, chunks: list) -> None:
    pieces = []
    for chunk in chunks:
        for c in chunk["choices"]:
            pieces.append(c.get("text") or c.get("delta", {}).get("content") or "")
    assert "".join(pieces) == text(base)


def usage_chunk(_: Send, base: dict, chunks: list) -> None:
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == base["usage"]


def stop_at_substring(send: Send, base: dict, resp: dict) -> None:
    full = text(base)
    stop = full[3:5]
    cut = send({"stop": stop})
    assert text(cut) == full[: full.index(stop)]
    kept = send({"stop": stop, "include_stop_str_in_output": True})
    assert text(kept) == full[: full.index(stop) + len(stop)]


def completion_logprobs(_: Send, base: dict, resp: dict) -> None:
    lp = resp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == resp["usage"]["completion_tokens"]
    # The top-2 (tokens that decode alike, e.g. to U+FFFD, share a key) plus the chosen one.
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])
    assert any(len(top) >= 2 for top in lp["top_logprobs"])


def chat_logprobs(k: int) -> Check:
    def check(_: Send, base: dict, resp: dict) -> None:
        content = resp["choices"][0]["logprobs"]["content"]
        assert len(content) == resp["usage"]["completion_tokens"]
        assert all(len(c["top_logprobs"]) == k for c in content)

    return check


def echoed(_: Send, base: dict, resp: dict) -> None:
    assert text(resp) == PROMPT + text(base)


def has_prompt_logprobs(_: Send, base: dict, resp: dict) -> None:
    entries = (
        resp["choices"][0]["prompt_logprobs"]
        if "text" in resp["choices"][0]
        else (resp["prompt_logprobs"])
    )
    assert entries[0] is None and len(entries) == resp["usage"]["prompt_tokens"]


def prompt_tokens_differ(sign: int) -> Check:
    def check(_: Send, base: dict, resp: dict) -> None:
        delta = resp["usage"]["prompt_tokens"] - base["usage"]["prompt_tokens"]
        assert delta * sign > 0, delta

    return check


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}


def follows_schema(_: Send, base: dict, resp: dict) -> None:
    """Grammar-constrained: the tiny random model writes a valid instance and stops."""
    assert resp["choices"][0]["finish_reason"] == "stop"
    value = json.loads(text(resp))
    assert set(value) == {"color", "n"} and value["color"] in ("red", "green")
    assert isinstance(value["n"], int) and value["n"] <= 99


def json_object(_: Send, base: dict, resp: dict) -> None:
    out = text(resp)
    assert out.startswith("{")  # the unconstrained greedy text does not
    if resp["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(out), dict)


# ----- the tables -----
COMPLETION_ROWS: list[tuple[str, dict, Check | Refused]] = [
    ("model", {"model": "nope"}, Refused("model")),
    ("prompt", {}, lambda s, b, r: (text(r) != "") or None),
    ("best_of", {"best_of": 1}, same),
    ("best_of", {"best_of": 2}, Refused("best_of")),
    ("echo", {"echo": True}, echoed),
    ("frequency_penalty", *penalised("frequency_penalty")),
    ("logit_bias", {"logit_bias": {"5": 10}}, Refused("logit_bias")),
    ("logprobs", {"logprobs": 2}, completion_logprobs),
    ("max_tokens", {"max_tokens": 3}, tokens(3)),
    ("n", {"n": 2}, num_choices(2)),
    ("presence_penalty", *penalised("presence_penalty")),
    ("seed", {"temperature": 1.5, "seed": 5}, seeded),
    ("stop", {}, stop_at_substring),
    ("stream", {"stream": True}, streamed),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": True}},
     usage_chunk),
    ("stream_options", {"stream_options": {"include_usage": True}}, Refused("stream_options")),
    ("suffix", {"suffix": "x"}, Refused("suffix")),
    ("temperature", {"temperature": 2.0, "seed": 1}, hot),
    ("top_p", {"temperature": 1.0, "top_p": 1e-6, "seed": 3}, greedy_equal),
    ("user", {"user": "someone"}, same),
    # vLLM's extensions declared by this server
    ("top_k", {"temperature": 1.0, "top_k": 1, "seed": 3}, greedy_equal),
    ("min_p", {"temperature": 1.0, "min_p": 1.0, "seed": 3}, greedy_equal),
    ("repetition_penalty", *penalised("repetition_penalty")),
    ("include_stop_str_in_output", {}, stop_at_substring),
    ("prompt_logprobs", {"prompt_logprobs": 1}, has_prompt_logprobs),
    ("response_format", {"response_format": {"type": "text"}}, same),
    ("response_format", {"response_format": {"type": "json_object"}, "max_tokens": 40},
     json_object),
    ("response_format", {"response_format": JSON_SCHEMA_FORMAT, "max_tokens": 40}, follows_schema),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     Refused("response_format.json_schema.schema")),
    ("response_format",
     {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     Refused("response_format")),
    ("guided_json", {"guided_json": SCHEMA, "max_tokens": 40}, follows_schema),
    ("guided_json", {"guided_json": SCHEMA, "response_format": {"type": "json_object"}},
     Refused("guided_json")),
    ("(unknown)", {"use_beam_search": True}, Refused("use_beam_search")),
]  # fmt: skip

TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
]  # fmt: skip


def rendered(resp: dict) -> str:
    return "".join(next(iter(e.values()))["decoded_token"] for e in resp["prompt_logprobs"][1:])


def tool_history_rendered(_: Send, base: dict, resp: dict) -> None:
    prompt = rendered(resp)
    assert '<call>get_weather({"city": "Paris"})</call>' in prompt
    assert "<|tool|>call_1: 22C" in prompt


def template_kwargs_rendered(_: Send, base: dict, resp: dict) -> None:
    assert "<|system|>be brief" in rendered(resp)


def continued(_: Send, base: dict, resp: dict) -> None:
    assert rendered(resp).endswith("<|assistant|>Sure")  # no end-of-turn, no new turn


CHAT_ROWS: list[tuple[str, dict, Check | Refused]] = [
    ("messages", {}, lambda s, b, r: None),
    ("messages", {"messages": TOOL_HISTORY, "prompt_logprobs": 0}, tool_history_rendered),
    ("messages", {"messages": [{"role": "user", "content": "hi", "refusal": "no"}]},
     Refused("messages.0.refusal")),
    ("model", {"model": "nope"}, Refused("model")),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}, Refused("audio")),
    ("frequency_penalty", *penalised("frequency_penalty")),
    ("function_call", {"function_call": "auto"}, Refused("function_call")),
    ("functions", {"functions": [{"name": "f"}]}, Refused("functions")),
    ("logit_bias", {"logit_bias": {"5": 10}}, Refused("logit_bias")),
    ("logprobs", {"logprobs": True}, chat_logprobs(0)),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 2}, chat_logprobs(2)),
    ("top_logprobs", {"top_logprobs": 2}, Refused("top_logprobs")),
    ("max_completion_tokens", {"max_completion_tokens": 3}, tokens(3)),
    ("max_tokens", {"max_tokens": 3}, tokens(3)),
    ("metadata", {"metadata": {"a": "b"}}, Refused("metadata")),
    ("modalities", {"modalities": ["text"]}, same),
    ("modalities", {"modalities": ["text", "audio"]}, Refused("modalities")),
    ("moderation", {"moderation": {"type": "auto"}}, Refused("moderation")),
    ("n", {"n": 2}, num_choices(2)),
    ("parallel_tool_calls", {"parallel_tool_calls": False}, same),  # no tools: nothing to do
    ("prediction", {"prediction": {"type": "content", "content": "x"}}, Refused("prediction")),
    ("presence_penalty", *penalised("presence_penalty")),
    ("prompt_cache_key", {"prompt_cache_key": "k"}, same),
    ("prompt_cache_options", {"prompt_cache_options": {}}, same),
    ("prompt_cache_retention", {"prompt_cache_retention": "24h"}, same),
    ("reasoning_effort", {"reasoning_effort": "low"}, Refused("reasoning_effort")),
    ("response_format", {"response_format": {"type": "text"}}, same),
    ("response_format", {"response_format": {"type": "json_object"}, "max_tokens": 40},
     json_object),
    ("response_format", {"response_format": JSON_SCHEMA_FORMAT, "max_tokens": 40}, follows_schema),
    ("safety_identifier", {"safety_identifier": "u1"}, same),
    ("seed", {"temperature": 1.5, "seed": 5}, seeded),
    ("service_tier", {"service_tier": "auto"}, same),
    ("service_tier", {"service_tier": "priority"}, Refused("service_tier")),
    ("stop", {}, stop_at_substring),
    ("store", {"store": False}, same),
    ("store", {"store": True}, Refused("store")),
    ("stream", {"stream": True}, streamed),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": True}},
     usage_chunk),
    ("temperature", {"temperature": 2.0, "seed": 1}, hot),
    # tools / tool_choice: behaviour through a tool-call parser in tests/service/test_chat_tools.py;
    # here (a server started without one) tool_choice 'none' changes nothing, and tools alone
    # mean tool_choice 'auto', which needs --enable-auto-tool-choice: refused, naming it.
    ("tool_choice", {"tool_choice": "none"}, same),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, Refused("tool_choice")),
    ("top_p", {"temperature": 1.0, "top_p": 1e-6, "seed": 3}, greedy_equal),
    ("user", {"user": "someone"}, same),
    ("verbosity", {"verbosity": "low"}, Refused("verbosity")),
    ("web_search_options", {"web_search_options": {}}, Refused("web_search_options")),
    ("metadata", {"metadata": {}}, Refused("metadata")),
    # vLLM's extensions declared by this server
    ("add_generation_prompt", {"add_generation_prompt": False}, prompt_tokens_differ(-1)),
    ("continue_final_message",
     {"messages": [*MESSAGES, {"role": "assistant", "content": "Sure"}],
      "add_generation_prompt": False, "continue_final_message": True, "prompt_logprobs": 0},
     continued),
    ("continue_final_message", {"continue_final_message": True},
     Refused("continue_final_message")),
    ("chat_template_kwargs",
     {"chat_template_kwargs": {"system_note": "be brief"}, "prompt_logprobs": 0},
     template_kwargs_rendered),
    ("chat_template_kwargs", {"chat_template_kwargs": {"tokenize": True}},
     Refused("chat_template_kwargs")),
    ("prompt_logprobs", {"prompt_logprobs": 1}, has_prompt_logprobs),
    ("guided_json", {"guided_json": SCHEMA, "max_tokens": 40}, follows_schema),
    ("top_k", {"temperature": 1.0, "top_k": 1, "seed": 3}, greedy_equal),
    ("repetition_penalty", *penalised("repetition_penalty")),
    ("(unknown)", {"chat_template": "{{ 1 }}"}, Refused("chat_template")),
]  # fmt: skip


def _sdk_fields(params_module: Any) -> set[str]:
    return set(params_module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_every_field_has_a_row() -> None:
    cmpl = _sdk_fields(openai_types.completion_create_params)
    chat = _sdk_fields(openai_chat.completion_create_params)
    assert cmpl <= {row[0] for row in COMPLETION_ROWS}, cmpl - {r[0] for r in COMPLETION_ROWS}
    assert chat <= {row[0] for row in CHAT_ROWS}, chat - {r[0] for r in CHAT_ROWS}


def _run(server: ServerProcess, path: str, base_body: dict, extra: dict, check) -> None:
    body = {**base_body, **extra}
    if isinstance(check, Refused):
        r = server.post(path, json=body)
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"]["param"] == check.param, r.text
        assert server.post(path, json=base_body).status_code == 200  # still serving
        return
    baseline = post(server, path, base_body)
    check(
        lambda more: post(server, path, {**base_body, **more}), baseline, post(server, path, body)
    )


@pytest.mark.parametrize(
    ("field", "extra", "check"),
    COMPLETION_ROWS,
    ids=[f"{r[0]}-{i}" for i, r in enumerate(COMPLETION_ROWS)],
)
def test_completions_field(server, field, extra, check) -> None:
    base = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _run(server, CMPL, base, extra, check)


@pytest.mark.parametrize(
    ("field", "extra", "check"), CHAT_ROWS, ids=[f"{r[0]}-{i}" for i, r in enumerate(CHAT_ROWS)]
)
def test_chat_field(chat_server, field, extra, check) -> None:
    base = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _run(chat_server, CHAT, base, extra, check)


# ----- the vLLM sampling extras that need the model's own token ids -----
@pytest.fixture(scope="module")
def first_greedy_token(server, model_dir) -> tuple[list[int], int]:
    ids = server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    with torch.no_grad():
        logits = make_reference_model(model_dir)(torch.tensor([ids])).logits[0, -1]
    return ids, int(logits.argmax())


def test_stop_token_ids_and_min_tokens(server, first_greedy_token) -> None:
    ids, first = first_greedy_token
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "stop_token_ids": [first]}
    r = post(server, CMPL, body)
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1
    # The stop token is counted but is not text, unless include_stop_str_in_output (vLLM's).
    assert r["choices"][0]["text"] == ""
    kept = post(server, CMPL, {**body, "include_stop_str_in_output": True})["choices"][0]["text"]
    assert kept == server.post("/detokenize", json={"tokens": [first]}).json()["prompt"] != ""
    r = post(server, CMPL, {**body, "min_tokens": 3})
    assert r["usage"]["completion_tokens"] >= 3


def test_ignore_eos_and_skip_special_tokens(server) -> None:
    """Near-uniform sampling (temperature 100) draws the EOS token within 64 tokens for one of
    16 seeded choices; the same seeds with ignore_eos run to the length limit, and with
    skip_special_tokens=false the EOS token shows in the text."""
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 100.0, "n": 16}
    for seed in range(0, 160, 16):
        r = post(server, CMPL, {**body, "seed": seed})
        stopped = [c["index"] for c in r["choices"] if c["finish_reason"] == "stop"]
        if stopped:
            break
    else:
        pytest.fail("no seed drew EOS")
    ignoring = post(server, CMPL, {**body, "seed": seed, "ignore_eos": True})
    assert all(c["finish_reason"] == "length" for c in ignoring["choices"])
    shown = post(
        server, CMPL, {**body, "seed": seed, "ignore_eos": True, "skip_special_tokens": False}
    )
    i = stopped[0]
    assert "<eos>" in shown["choices"][i]["text"]
    assert "<eos>" not in ignoring["choices"][i]["text"]
