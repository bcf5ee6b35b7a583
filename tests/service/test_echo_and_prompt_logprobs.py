"""Completions `echo` (with the prompt's logprobs), `max_tokens: 0` scoring, and
`prompt_logprobs` on both endpoints, through the official `openai` client against the shared
server (tiny random DeepSeek-V3, fp32 on CPU).

Oracle: transformers' DeepseekV3ForCausalLM in fp32 on the same checkpoint, one forward over the
prompt; log_softmax(logits[p])[prompt[p + 1]] scores prompt token p + 1. Tolerance 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import make_reference_model
from tests.service.server_process import ServerProcess

TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog. Hello world!"


@pytest.fixture(scope="module")
def reference(model_dir):
    return make_reference_model(model_dir)


@pytest.fixture(scope="module")
def prompt_ids(server: ServerProcess) -> list[int]:
    return server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]


@torch.no_grad()
def hf_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is the log-distribution of token p + 1."""
    return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_scores_the_prompt(openai_client, model_name, reference, prompt_ids):
    # What lm-eval's local-completions sends for a log-likelihood request.
    r = openai_client.completions.create(
        model=model_name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    choice = r.choices[0]
    lp = choice.logprobs
    n = len(prompt_ids)
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT) - 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = hf_logprobs(reference, prompt_ids)
    for j in range(1, n):
        assert abs(lp.token_logprobs[j] - float(expected[j - 1, prompt_ids[j]])) < TOL, j
        top_value = max(lp.top_logprobs[j].values())
        assert abs(top_value - float(expected[j - 1].max())) < TOL
    # The generated token comes last, scored by the last prompt position.
    assert abs(lp.token_logprobs[n] - float(expected[n - 1].max())) < TOL  # greedy
    # text_offset walks the echoed text.
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert r.usage.completion_tokens == 1 and r.usage.prompt_tokens == n


def test_max_tokens_0_with_echo_scores_only(openai_client, model_name, reference, prompt_ids):
    r = openai_client.completions.create(
        model=model_name, prompt=prompt_ids, echo=True, logprobs=0, max_tokens=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    assert "".join(choice.logprobs.tokens) == choice.text
    expected = hf_logprobs(reference, prompt_ids)
    got = choice.logprobs.token_logprobs[1:]
    want = [float(expected[j - 1, prompt_ids[j]]) for j in range(1, len(prompt_ids))]
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL
    assert r.usage.completion_tokens == 0


def test_echo_without_logprobs_and_streamed(openai_client, model_name) -> None:
    kw = {"model": model_name, "prompt": [PROMPT, "Hello"], "echo": True, "max_tokens": 5}
    whole = openai_client.completions.create(**kw, temperature=0, logprobs=2)
    streamed: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for chunk in openai_client.completions.create(**kw, temperature=0, logprobs=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
    for c in whole.choices:
        assert c.text.startswith([PROMPT, "Hello"][c.index])
        assert streamed[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens
    plain = openai_client.completions.create(**kw, temperature=0)
    assert [c.text for c in plain.choices] == [c.text for c in whole.choices]
    assert plain.choices[0].logprobs is None


def test_prompt_logprobs_on_completions(server, model_name, reference, prompt_ids) -> None:
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    check_prompt_logprobs(entries, prompt_ids, reference, k=2)
    plain = server.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_prompt_logprobs_on_chat(server, model_name, reference) -> None:
    messages = [{"role": "user", "content": "Hello world! How are you today?"}]
    ids = server.post("/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"model": model_name, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    check_prompt_logprobs(r.json()["prompt_logprobs"], ids, reference, k=0)


def check_prompt_logprobs(entries, ids, reference, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    expected = hf_logprobs(reference, ids)
    for j in range(1, len(ids)):
        entry = {int(t): v for t, v in entries[j].items()}
        row = expected[j - 1]
        assert abs(entry[ids[j]]["logprob"] - float(row[ids[j]])) < TOL
        assert entry[ids[j]]["rank"] == int((row >= row[ids[j]]).sum())
        ranked = sorted(v["rank"] for v in entry.values() if v["rank"] <= k)
        assert ranked == list(range(1, k + 1))


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
         "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True},
         "prompt_logprobs"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(server, model_name, path, body, param) -> None:
    r = server.post(path, json={"model": model_name, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
