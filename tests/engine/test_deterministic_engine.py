"""The engine in the deterministic mode (`deterministic_inference=True`): greedy requests run
alone and all together give the same tokens and bitwise the same logprobs (issue 40's greedy
agreement, made exact).

CPU: the default model (fp32, the mode's torch path) with prefill chunks forced small
(`max_num_batched_tokens` 16), so a prompt alone and the same prompt among others are cut into
different chunks and share forwards with other requests' chunks and decodes. GPU (`-m gpu`):
the default model in bf16 with the FP8 cache, CUDA graphs (decode and piecewise prefill),
overlap scheduling, MTP speculation k = 3 and a KV pool small enough to preempt.

Also the mode's configuration rules and its CLI flag.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.config import ConfigError, EngineConfig

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "hello world",
    "Multi-head latent attention compresses keys and values into a small latent vector, "
    "and a mixture of experts routes every token to a few experts",
    "x",
    "one two three four five six seven eight nine ten eleven twelve",
    "The capital of France is",
    "user: what is the answer? assistant: 42. " * 3,
    "0123456789 +-*/=()[]{}<>,.;:!?",
]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)


def _tokens_and_logprobs(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)]


def _alone_vs_together(
    llm: LLM, prompts: list[str], params: SamplingParams, logprob_tol: float = 0.0
) -> None:
    """Tokens identical; logprobs within `logprob_tol` (0: bitwise)."""
    alone = [_tokens_and_logprobs(llm.generate([p], params, use_tqdm=False)[0]) for p in prompts]
    together = [_tokens_and_logprobs(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert a[0] == b[0], f"prompt {i}: tokens differ alone vs together"
        gap = max((abs(x - y) for x, y in zip(a[1], b[1], strict=True)), default=0.0)
        assert gap <= logprob_tol, f"prompt {i}: logprobs differ by {gap} alone vs together"


@pytest.fixture
def one_torch_thread():
    """The mode's CPU path is thousands of tiny torch ops a step: with the engine's own threads
    on a small machine, intra-op thread pools spin against them (measured: 50x slower on 2
    cores). The server sets its threads likewise (`cli.resolve_torch_threads`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_cpu_greedy_alone_equals_together_with_small_chunks() -> None:
    llm = LLM(
        device="cpu",
        dtype="bfloat16",  # the served dtype: torch's own bf16 GEMMs here vary with the batch
        deterministic_inference=True,
        max_num_batched_tokens=16,
        page_size=4,
        enable_prefix_caching=False,  # "together" must prefill what "alone" did, batched
    )
    _alone_vs_together(llm, PROMPTS, _greedy(16))


def test_config_rules() -> None:
    assert EngineConfig(deterministic_inference=True).resolved_attention_backend() == "invariant"
    assert EngineConfig().resolved_attention_backend() == "auto"
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(deterministic_inference=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="invariant"):
        EngineConfig(deterministic_inference=True, attention_backend="flashmla")
    with pytest.raises(ConfigError, match="deterministic_inference"):
        EngineConfig(deterministic_inference="yes")


def test_cli_flag_sets_the_option() -> None:
    from mlaserve.service.cli import build_parser

    parser = build_parser()
    for flag in ("--enable-deterministic-inference", "--deterministic-inference"):
        args = parser.parse_args(["serve", flag])
        assert args.deterministic_inference is True
    assert not hasattr(parser.parse_args(["serve"]), "deterministic_inference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="graphs-overlap"),
        pytest.param({"num_speculative_tokens": 3}, id="spec3"),
        pytest.param({"num_pages": 24, "page_size": 16}, id="preemption"),
        pytest.param(
            {"num_speculative_tokens": 3, "num_pages": 28, "page_size": 16}, id="spec3-preemption"
        ),
    ],
)
def test_gpu_greedy_alone_equals_together(options: dict) -> None:
    llm = LLM(
        device="cuda",
        deterministic_inference=True,
        max_num_batched_tokens=64,  # prompts cut into chunks, mixed with decodes
        max_num_seqs=16,
        enable_prefix_caching=False,  # "together" must prefill what "alone" did, batched
        **options,
    )
    prompts = [p * (1 + i % 4) for i, p in enumerate(PROMPTS)] * 2
    # The logits are bitwise invariant; the sampler's logprob is logit - logsumexp(row), and
    # torch's CUDA logsumexp picks its reduction layout by the number of rows: an ulp or so.
    _alone_vs_together(llm, prompts, _greedy(48), logprob_tol=1e-5)
    stats = llm.engine.get_stats()
    if "num_pages" in options:
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    assert stats.num_free_pages == stats.num_total_pages
