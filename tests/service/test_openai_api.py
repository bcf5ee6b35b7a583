"""End-to-end: the official `openai` client against a real server serving a real (tiny) model."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.service.server_process import ServerProcess

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_models_version_tokenizer(server: ServerProcess, openai_client, model_name) -> None:
    models = openai_client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].model_extra["max_model_len"] == 256
    assert server.get("/version").json()["version"]

    tokens = server.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 256
    text = server.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def test_completion_usage_and_finish_reason(server, openai_client, model_name) -> None:
    out = openai_client.completions.create(
        model=model_name, prompt="Hello world", max_tokens=8, **GREEDY
    )
    prompt_len = server.post("/tokenize", json={"prompt": "Hello world"}).json()["count"]
    assert out.object == "text_completion" and out.model == model_name
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == prompt_len
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == prompt_len + 8


def test_prompt_forms(openai_client, model_name, server) -> None:
    ids = server.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    by_text = openai_client.completions.create(
        model=model_name, prompt="The quick brown fox", max_tokens=6, **GREEDY
    )
    by_ids = openai_client.completions.create(model=model_name, prompt=ids, max_tokens=6, **GREEDY)
    both = openai_client.completions.create(
        model=model_name, prompt=["The quick brown fox", "Hello"], max_tokens=6, **GREEDY
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text
    hello_len = server.post("/tokenize", json={"prompt": "Hello"}).json()["count"]
    assert both.usage.prompt_tokens == len(ids) + hello_len
    assert both.usage.completion_tokens == 12


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_text_equals_non_streamed(openai_client, model_name, server, endpoint) -> None:
    def reset() -> None:  # both requests start from an empty prefix cache: equal cached_tokens
        server.post("/reset_prefix_cache").raise_for_status()

    if endpoint == "chat":
        create = openai_client.chat.completions.create
        kwargs = {"messages": [{"role": "user", "content": "Tell me about foxes."}]}
    else:
        create = openai_client.completions.create
        kwargs = {"prompt": "Tell me about foxes."}
    reset()
    whole = create(model=model_name, max_tokens=24, **kwargs, **GREEDY)
    reset()
    chunks = list(
        create(
            model=model_name,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
            **GREEDY,
        )
    )
    assert chunks[-1].usage is not None and not chunks[-1].choices
    assert chunks[-1].usage == whole.usage
    choices = [c.choices[0] for c in chunks if c.choices]
    if endpoint == "chat":
        assert choices[0].delta.role == "assistant"
        streamed = "".join(c.delta.content or "" for c in choices)
        expected = whole.choices[0].message.content
    else:
        streamed = "".join(c.text for c in choices)
        expected = whole.choices[0].text
    assert streamed == expected
    assert choices[-1].finish_reason == whole.choices[0].finish_reason == "length"
    assert all(c.finish_reason is None for c in choices[:-1])


def test_n_choices_are_seeded_per_choice(openai_client, model_name) -> None:
    kwargs = {
        "model": model_name,
        "prompt": "Hello",
        "max_tokens": 8,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    three = openai_client.completions.create(n=3, seed=1234, **kwargs)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage.completion_tokens == 3 * 8
    assert len({c.text for c in three.choices}) > 1  # sampled with different seeds
    # Choice i of an n-request is the single request seeded with seed + i.
    for c in three.choices:
        single = openai_client.completions.create(seed=1234 + c.index, **kwargs)
        assert single.choices[0].text == c.text
    again = openai_client.completions.create(n=3, seed=1234, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in three.choices]


def test_n_streaming_interleaves_choices(openai_client, model_name) -> None:
    stream = openai_client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        n=2,
        stream=True,
        **GREEDY,
    )
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert texts[0] == texts[1]  # greedy: both choices agree


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(openai_client, model_name, stream) -> None:
    kwargs = {"model": model_name, "prompt": "The answer is", "max_tokens": 16, **GREEDY}
    full = openai_client.completions.create(**kwargs).choices[0].text
    # A stop string from the greedy output itself, at its first occurrence.
    cut = next(
        i
        for i in range(2, len(full) - 2)
        if "\ufffd" not in full[i : i + 2] and full.find(full[i : i + 2]) == i
    )
    stop = full[cut : cut + 2]
    if stream:
        chunks = list(openai_client.completions.create(stop=[stop], stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        last = [c.choices[0] for c in chunks if c.choices][-1]
        reason, stop_reason = last.finish_reason, last.model_extra["stop_reason"]
        # only the last chunk names it: the others carry null
        assert all(c.choices[0].model_extra["stop_reason"] is None for c in chunks[:-2])
    else:
        out = openai_client.completions.create(stop=stop, **kwargs).choices[0]
        text, reason, stop_reason = out.text, out.finish_reason, out.model_extra["stop_reason"]
    assert text == full[:cut]
    assert reason == "stop"
    assert stop_reason == stop  # vLLM's field: the stop string that ended the choice


@pytest.mark.parametrize("stream", [False, True])
def test_chat_stop_reason(openai_client, model_name, stream) -> None:
    kwargs = {"model": model_name, "max_tokens": 16, "temperature": 0.0,
              "extra_body": {"ignore_eos": True},
              "messages": [{"role": "user", "content": "The answer is"}]}  # fmt: skip
    full = openai_client.chat.completions.create(**kwargs).choices[0]
    assert full.model_extra["stop_reason"] is None  # ended by max_tokens
    text = full.message.content
    cut = next(i for i in range(2, len(text) - 2)
               if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i)  # fmt: skip
    stop = text[cut : cut + 2]
    if stream:
        chunks = list(openai_client.chat.completions.create(stop=[stop], stream=True, **kwargs))
        last = [c.choices[0] for c in chunks if c.choices][-1]
    else:
        last = openai_client.chat.completions.create(stop=[stop], **kwargs).choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop


def test_completion_logprobs(openai_client, model_name) -> None:
    out = openai_client.completions.create(
        model=model_name, prompt="Hello", max_tokens=6, logprobs=3, **GREEDY
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text or "\ufffd" in out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0.0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top-1
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(openai_client, model_name) -> None:
    out = openai_client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


def test_chat_usage_matches_the_template(server, openai_client, model_name) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    out = openai_client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=4, **GREEDY
    )
    prompt_len = server.post("/tokenize", json={"messages": messages}).json()["count"]
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == prompt_len
    assert out.usage.completion_tokens == 4


def test_64_concurrent_streams_complete_correctly(server, model_name) -> None:
    prompts = [f"Request number {i}: the quick brown fox" for i in range(64)]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    # Reference: the same prompts, greedy, in one non-streaming request.
    reference = client.completions.create(model=model_name, prompt=prompts, max_tokens=8, **GREEDY)
    expected = {c.index: c.text for c in reference.choices}
    client.close()

    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await aclient.completions.create(
            model=model_name,
            prompt=prompts[i],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        text, reason, usage = "", None, None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                reason = choice.finish_reason or reason
            usage = chunk.usage or usage
        return text, reason, usage.completion_tokens

    async def all_of_them() -> list[tuple[str, str | None, int]]:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    assert [r[2] for r in results] == [8] * 64
    assert [r[1] for r in results] == ["length"] * 64
    assert [r[0] for r in results] == [expected[i] for i in range(64)]
    assert server.metric("mlaserve:num_requests_running") == 0


def test_sampling_extras_reach_the_sampler(openai_client, model_name) -> None:
    kwargs = {"model": model_name, "prompt": "The quick brown fox", "max_tokens": 24}
    plain = openai_client.completions.create(**kwargs, **GREEDY).choices[0].text
    penalised = openai_client.completions.create(
        **kwargs,
        temperature=0.0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 2.0},
    )
    assert penalised.usage.completion_tokens == 24
    assert penalised.choices[0].text != plain  # the penalties changed the greedy path
    sampled = {
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": 11,
        "extra_body": {"top_k": 5, "min_p": 0.01, "min_tokens": 4, "ignore_eos": True},
    }
    first = openai_client.completions.create(**kwargs, **sampled)
    second = openai_client.completions.create(**kwargs, **sampled)
    assert first.choices[0].text == second.choices[0].text  # seeded: reproducible
    assert first.usage.completion_tokens == 24
