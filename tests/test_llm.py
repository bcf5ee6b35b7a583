"""The offline `LLM` API as vLLM users call it: prompt dicts, use_tqdm, get_tokenizer(), and a
generate that fails or is interrupted leaving no request of its own behind."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from mlaserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    path = checkpoint("v3_moe")
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="auto", page_size=4)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_prompt_dicts_equal_plain_prompts(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("Hello world")
    plain = llm.generate(["Hello world", ids], GREEDY, use_tqdm=False)
    dicts = llm.generate(
        [{"prompt": "Hello world"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False
    )
    assert texts(dicts) == texts(plain)
    assert dicts[0].prompt_token_ids == ids
    # One dict alone is one prompt, not a sequence of keys.
    assert (
        texts(llm.generate({"prompt": "Hello world"}, GREEDY, use_tqdm=False)) == texts(plain)[:1]
    )


@pytest.mark.parametrize(
    "bad",
    [{"text": "hi"}, {"prompt": "hi", "multi_modal_data": {}}, {"prompt_token_ids": "12"}],
)
def test_other_dicts_are_refused(llm: LLM, bad: dict) -> None:
    with pytest.raises(ValueError, match=r"prompts\[0\]: a prompt dict must be"):
        llm.generate(bad, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_get_tokenizer_is_the_engine_tokenizer(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert tok is llm.engine.tokenizer
    assert tok.decode(tok.encode("Hello world"), skip_special_tokens=True) == "Hello world"


def test_use_tqdm_counts_finished_requests(llm: LLM, capsys) -> None:
    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2, n=2), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "6/6" in err

    bars: list[tqdm] = []

    def make_bar(*args, **kwargs) -> tqdm:
        bar = tqdm(*args, file=io.StringIO(), **kwargs)
        bars.append(bar)
        return bar

    llm.generate(["a", "b"], GREEDY, use_tqdm=make_bar)
    assert len(bars) == 1 and bars[0].n == 2 and bars[0].total == 2
    llm.generate(["a"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_a_bad_second_prompt_aborts_the_first(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["fine", [vocab + 5]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.requests == {}
    stats = llm.engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages


def test_an_interrupted_generate_aborts_its_requests(llm: LLM) -> None:
    class Interrupting(tqdm):
        """Ctrl-C arrives while the first request finishes (from the progress callback)."""

        def update(self, n: int = 1) -> bool | None:
            raise KeyboardInterrupt

    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(
            ["x", "y", "z"],
            [short, long, long],
            use_tqdm=lambda **kw: Interrupting(disable=True, **kw),
        )
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.requests == {}
    stats = llm.engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages
    # The next call runs only its own request: one step for a one-token prompt.
    before = llm.engine.num_steps
    llm.generate(["x"], short, use_tqdm=False)
    assert llm.engine.num_steps == before + 1
