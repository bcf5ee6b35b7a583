"""The offline `LLM` API as vLLM users call it: prompt dicts, use_tqdm, get_tokenizer(), a
generate that fails or is interrupted leaving no request of its own behind, vLLM's engine
keywords with their `mlaserve serve` meaning, and the CLI's words for a hub id."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from mlaserve import LLM, SamplingParams
from mlaserve.config import ConfigError, EngineConfig, default_model_path
from mlaserve.config.vllm_flags import engine_options
from mlaserve.service.cli import main, parse_settings

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


# ----- vLLM's engine keywords (issue 45, item 2) -----

# keyword -> (value, the `mlaserve serve` arguments that mean the same)
VLLM_KEYWORDS = {
    "tensor_parallel_size": (1, ("-tp", "1")),
    "trust_remote_code": (True, ("--trust-remote-code",)),
    "enforce_eager": (True, ("--enforce-eager",)),
    "gpu_memory_utilization": (0.5, ("--gpu-memory-utilization", "0.5")),
    "max_model_len": (256, ("--max-model-len", "256")),
    "dtype": ("float", ("--dtype", "float")),
    "seed": (3, ("--seed", "3")),
    "kv_cache_dtype": ("auto", ("--kv-cache-dtype", "auto")),
    # on by default (vLLM's default too): the keyword that changes something turns it off
    "enable_prefix_caching": (False, ("--no-enable-prefix-caching",)),
    "speculative_config": (
        {"method": "deepseek_mtp", "num_speculative_tokens": 2},
        ("--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 2}'),
    ),
}


@pytest.mark.parametrize("name", VLLM_KEYWORDS)
def test_a_vllm_keyword_means_what_its_serve_flag_means(name: str) -> None:
    """The offline keyword and the CLI flag go through one table: the same EngineConfig."""
    value, argv = VLLM_KEYWORDS[name]
    options, _ = engine_options({name: value}, EngineConfig.field_names())
    _, settings = parse_settings(["serve", *argv], {})
    assert EngineConfig(**options) == settings.engine


def test_llm_takes_vllm_engine_keywords(caplog) -> None:
    """vLLM's DeepSeek examples' keywords, all at once, on the shipped default model."""
    kwargs = {name: value for name, (value, _) in VLLM_KEYWORDS.items()}
    with caplog.at_level("INFO", logger="mlaserve.llm"):
        llm = LLM(str(default_model_path()), device="cpu", max_num_seqs=2, **kwargs)
    config = llm.engine.config
    assert config.cuda_graph is False and config.dtype == "float32" and config.seed == 3
    assert config.max_model_len == 256 and not config.enable_prefix_caching
    assert config.speculative is not None and config.speculative.k == 2
    assert config.trust_remote_code is True  # an engine option (a tokenizer shipped as code)
    assert "vLLM keyword --enforce-eager" in caplog.text
    out = llm.generate("def f(x):", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.shutdown()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"data_parallel_size": 8}, ConfigError, r"--data-parallel-size is not supported.*-tp N"),
        ({"speculative_config": {"method": "eagle"}}, ConfigError, r"'eagle' is not supported"),
        ({"host": "0.0.0.0"}, TypeError, r"'host' is a server option \(--host"),
        ({"uvicorn_log_level": "info"}, TypeError, r"server option"),
        ({"no_such_option": 1}, TypeError, r"unknown engine option\(s\) \['no_such_option'\]"),
        ({"enforce_eager": True, "cuda_graph": True}, ConfigError, r"cuda_graph: set to"),
    ],
)
def test_refused_and_unknown_keywords_say_why(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        LLM(str(default_model_path()), device="cpu", **kwargs)


def test_a_hub_id_gets_the_clis_error(capsys) -> None:
    with pytest.raises(ConfigError) as refused:
        LLM("deepseek-ai/DeepSeek-V2-Lite")
    assert main(["serve", "deepseek-ai/DeepSeek-V2-Lite"]) == 2
    assert capsys.readouterr().err == f"mlaserve: error: {refused.value}\n"
    assert "`hf download deepseek-ai/DeepSeek-V2-Lite --local-dir DIR`" in str(refused.value)
