"""The engine in the deterministic mode (`deterministic_inference=True`): greedy requests run
alone and all together give the same tokens and bitwise the same logprobs (issue 40's greedy
agreement, made exact).

CPU: the default model (fp32, the mode's torch path) with prefill chunks forced small
(`max_num_batched_tokens` 16), so a prompt alone and the same prompt among others are cut into
different chunks and share forwards with other requests' chunks and decodes. GPU (`-m gpu`):
the default model in bf16 with the FP8 cache, CUDA graphs (decode and piecewise prefill),
overlap scheduling, MTP speculation k = 3 and a KV pool small enough to preempt.

Tensor-parallel invariance: the same greedy requests at TP1, TP2 and TP4 (gloo on the CPU, bf16;
NCCL on 2 GPUs with graphs, overlap and MTP) give the same tokens and bitwise the same logprobs:
every sum a TP group splits is summed in one fixed tree (`ops/invariant_rowwise.py`).

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


def _greedy_runs(prompts: list[str], params: SamplingParams, sizes: tuple, **options) -> dict:
    """TP size -> [(tokens, logprobs)] per prompt, one engine at a time."""
    runs = {}
    for size in sizes:
        llm = LLM(deterministic_inference=True, tensor_parallel_size=size, **options)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[size] = [_tokens_and_logprobs(o) for o in outs]
        finally:
            llm.shutdown()
        del llm
    return runs


@pytest.mark.usefixtures("one_torch_thread")
def test_cpu_tp2_and_tp4_equal_tp1_bitwise() -> None:
    runs = _greedy_runs(
        PROMPTS, _greedy(16), (1, 2, 4), device="cpu", dtype="bfloat16",
        max_num_batched_tokens=16, page_size=4, enable_prefix_caching=False,
    )  # fmt: skip
    for size in (2, 4):
        assert runs[size] == runs[1], f"TP{size} differs from TP1"


def test_config_rules() -> None:
    assert EngineConfig(deterministic_inference=True).resolved_attention_backend() == "invariant"
    assert EngineConfig().resolved_attention_backend() == "auto"
    for size in (2, 4, 8):  # the summation tree's divisors (tests/model/test_tp_invariance.py)
        EngineConfig(deterministic_inference=True, tensor_parallel_size=size)
    for size in (3, 6, 16):
        with pytest.raises(ConfigError, match="tensor_parallel_size must divide 8"):
            EngineConfig(deterministic_inference=True, tensor_parallel_size=size)
    with pytest.raises(ConfigError, match="enable_expert_parallel"):
        EngineConfig(
            deterministic_inference=True, tensor_parallel_size=2, enable_expert_parallel=True
        )
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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="graphs-overlap"),
        pytest.param({"num_speculative_tokens": 3}, id="spec3"),
    ],
)
def test_gpu_tp2_equals_tp1_bitwise(options: dict) -> None:
    """Served configuration (bf16, FP8 KV, graphs with the tree's all-gather inside, overlap):
    TP2's tokens equal TP1's; logprobs within 1e-5 (torch's CUDA logsumexp lays out its
    reduction by the number of rows, should the two step other batches)."""
    prompts = [p * (1 + i % 4) for i, p in enumerate(PROMPTS)] * 2
    runs = _greedy_runs(
        prompts, _greedy(48), (1, 2), device="cuda", max_num_batched_tokens=64, max_num_seqs=16,
        enable_prefix_caching=False, **options,
    )  # fmt: skip
    for i, (tp1, tp2) in enumerate(zip(runs[1], runs[2], strict=True)):
        assert tp2[0] == tp1[0], f"prompt {i}: TP2's tokens differ from TP1's"
        gap = max(abs(a - b) for a, b in zip(tp1[1], tp2[1], strict=True))
        assert gap <= 1e-5, f"prompt {i}: logprobs differ by {gap}"
