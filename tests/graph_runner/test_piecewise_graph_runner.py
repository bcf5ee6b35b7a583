"""Piecewise prefill graphs' bucket, padding and static-buffer logic on CPU, through the same code
path the GPU takes, with the pieces run eagerly and the real attention at each break
(`use_graphs=False`)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from mlaserve import LLM
from mlaserve.config import ConfigError, EngineConfig
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.graph_runner import CudaGraphRunner
from mlaserve.graph_runner.piecewise_graph_runner import token_buckets
from tests.graph_runner.harness import (
    add_requests,
    compare_extends,
    finish_requests,
    poison_kv,
    untouched_pages_still_poisoned,
)
from tests.kernels_adapter.reference_mha import ReferenceMHA

MAX_TOKENS = 64  # the engine's max_num_batched_tokens: buckets 16, 32, 64


class FreshCapturingMHA(ReferenceMHA):
    """The MHA-form reference backend, claiming what FlashMLA claims: one fresh prompt's prefill
    runs with the bucket's fixed layout (`fresh_layout`), so the piecewise runner takes its
    one-graph path (run eagerly here, `use_graphs=False`)."""

    captures_fresh_extend: ClassVar[bool] = True


def _cpu_engine(checkpoint, backend_cls=None, draft_reads_hidden: bool = False):
    llm = LLM(
        str(checkpoint("v3_moe")),
        device="cpu",
        dtype="float32",
        kv_cache_dtype="auto",
        page_size=4,
        max_model_len=160,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_TOKENS,
    )
    engine = llm.engine
    assert engine.graphs.piecewise is None, "no piecewise graphs on CPU by default"
    if backend_cls is not None:
        b = engine.runner.attn_backend
        engine.runner.attn_backend = backend_cls(
            b.model_config, b.page_size, b.kv_cache_dtype, b.device, b.max_num_seqs,
            b.max_model_len,
        )  # fmt: skip
    # as with a draft model: every EXTEND row's final hidden states are read, none pruned
    engine.runner.draft_reads_hidden = draft_reads_hidden
    engine.graphs = CudaGraphRunner(
        engine.runner, (1, 2, 4, 8), use_graphs=False, piecewise_max_tokens=MAX_TOKENS
    )
    engine.graphs.capture()  # eager warm-up of every bucket
    return engine


@pytest.fixture(scope="module")
def engine(checkpoint):
    return _cpu_engine(checkpoint)


@pytest.fixture(scope="module")
def mha_engine(checkpoint):
    return _cpu_engine(checkpoint, FreshCapturingMHA)


@pytest.fixture(scope="module")
def mha_engine_all_rows(checkpoint):
    return _cpu_engine(checkpoint, FreshCapturingMHA, draft_reads_hidden=True)


def test_token_buckets() -> None:
    assert token_buckets(64) == (16, 32, 64)
    assert token_buckets(100) == (16, 32, 64, 100)
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    assert token_buckets(5) == (5,)
    assert token_buckets(0) == ()


@pytest.mark.parametrize(
    "prompt_lens",
    [[5], [16], [17, 9], [3, 30, 11], [150], [100, 7, 40]],
    ids=["one-short", "one-full-bucket", "two", "three", "chunked", "chunked-mixed"],
)
def test_padded_extend_equals_eager(engine, prompt_lens: list[int]) -> None:
    """Every EXTEND step (prompts shorter than a bucket, exactly one, chunked prompts over a
    cached prefix mixed with fresh ones and with decodes) gives the logits of an unpadded eager
    forward on every token row, and padded rows never touch a live page (unused pages are
    NaN-poisoned)."""
    poison_kv(engine)
    add_requests(engine, prompt_lens, max_tokens=4, seed=len(prompt_lens))
    replays = engine.graphs.piecewise.num_replays
    report = compare_extends(engine, rel_tol=1e-5)
    assert report.steps >= 1
    assert engine.graphs.piecewise.num_replays - replays == report.steps
    assert report.max_rel_err < 1e-5, report.max_rel_err
    assert report.argmax_mismatches == 0
    if sum(prompt_lens) > MAX_TOKENS:
        assert report.steps >= 2  # chunked: a later chunk attends over a cached prefix
    assert untouched_pages_still_poisoned(engine, report.touched_pages)
    stats = finish_requests(engine)
    assert stats.num_free_pages == stats.num_total_pages


@pytest.mark.parametrize(
    "prompt_lens, one_graph_steps",
    [([5], 1), ([16], 1), ([40], 1), ([17, 9], 0), ([150], 1), ([100, 7, 40], 1)],
    ids=["one-short", "one-full-bucket", "one-padded", "two", "chunked", "chunked-mixed"],
)
@pytest.mark.parametrize("all_rows", [True, False], ids=["every-row", "logits-rows"])
def test_fresh_prompt_in_one_graph_equals_eager(
    mha_engine, mha_engine_all_rows, prompt_lens: list[int], one_graph_steps: int, all_rows: bool
) -> None:
    """With a backend whose fresh-prompt prefill captures whole (`captures_fresh_extend`), an
    EXTEND step of one prompt with no cached prefix runs the whole padded forward with the
    bucket's fixed layout (attention over the padded rows too), the others stay piecewise; the
    logits equal an unpadded eager forward's of every row and padded rows touch no live page.
    every-row: as with a draft model, the one graph computes every row, all compared.
    logits-rows: without one, it runs the last layer's o_proj and FFN on the sampled row alone
    (none for a chunk that samples nothing), and the sampled rows are compared. Chunked
    prompts: only their first chunk is fresh (a second chunk reads its prefix; several
    sequences in one step go piecewise)."""
    engine = mha_engine_all_rows if all_rows else mha_engine
    piecewise = engine.graphs.piecewise
    assert piecewise.one_graph and piecewise.whole_logits_only is not all_rows
    poison_kv(engine)
    add_requests(engine, prompt_lens, max_tokens=4, seed=7 + len(prompt_lens))
    before = piecewise.num_one_graph_replays
    report = compare_extends(engine, rel_tol=1e-5, all_rows=all_rows)
    assert piecewise.num_one_graph_replays - before == one_graph_steps
    assert report.max_rel_err < 1e-5, report.max_rel_err
    assert report.argmax_mismatches == 0
    assert untouched_pages_still_poisoned(engine, report.touched_pages)
    stats = finish_requests(engine)
    assert stats.num_free_pages == stats.num_total_pages


def test_one_graph_needs_a_backend_that_says_so(engine, monkeypatch) -> None:
    """The latent-form reference backend keeps every prefill piecewise; so does an opt-out."""
    assert not engine.graphs.piecewise.one_graph
    monkeypatch.setenv("MLASERVE_ONE_GRAPH_PREFILL", "0")
    pw = CudaGraphRunner(
        engine.runner, (1,), use_graphs=False, piecewise_max_tokens=MAX_TOKENS
    ).piecewise
    assert pw is not None and not pw.one_graph


def test_bucket_choice(engine) -> None:
    piecewise = engine.graphs.piecewise
    assert piecewise.buckets == (16, 32, 64)

    def extend(n: int) -> HostBatch:
        return HostBatch(
            ForwardMode.EXTEND, [0] * n, list(range(n)), [4] * n, [n], [n], [[1]], [n - 1]
        )

    assert piecewise.bucket_for(extend(1)) == 16
    assert piecewise.bucket_for(extend(16)) == 16
    assert piecewise.bucket_for(extend(17)) == 32
    assert piecewise.bucket_for(extend(64)) == 64
    assert piecewise.bucket_for(extend(65)) is None  # past the largest bucket: eager
    decode = HostBatch(ForwardMode.DECODE, [0], [5], [0], [6], [1], [[1]], [])
    assert piecewise.bucket_for(decode) is None
    piecewise.enabled = False
    try:
        assert piecewise.bucket_for(extend(8)) is None
        before = engine.graphs.num_eager_steps["extend"]
        engine.graphs.run(extend(8))
        assert engine.graphs.num_eager_steps["extend"] == before + 1
    finally:
        piecewise.enabled = True


def test_piecewise_options_are_validated() -> None:
    assert EngineConfig(device="cpu").resolved_piecewise_cuda_graph_max_tokens() == 0
    with pytest.raises(ConfigError, match="piecewise_cuda_graph: needs CUDA graphs"):
        EngineConfig(
            device="cpu", piecewise_cuda_graph=True
        ).resolved_piecewise_cuda_graph_max_tokens()
    for bad in (0, 4097, 2.5, True):
        with pytest.raises(ConfigError, match="piecewise_cuda_graph_max_tokens"):
            EngineConfig(max_num_batched_tokens=4096, piecewise_cuda_graph_max_tokens=bad)
    config = EngineConfig(device="cpu", cuda_graph=False, piecewise_cuda_graph=False)
    assert config.resolved_piecewise_cuda_graph_max_tokens() == 0
