"""The graph runner's buffer, padding and dispatch logic on CPU, through the same code path the
GPU takes, with eager forwards instead of replays (`use_graphs=False`)."""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM
from mlaserve.config import ConfigError, EngineConfig
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.input_buffers import HostBatch, InputBuffers
from mlaserve.graph_runner import CudaGraphRunner
from tests.graph_runner.harness import (
    add_requests,
    compare_replays,
    finish_requests,
    poison_kv,
    untouched_pages_still_poisoned,
)

SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def engine(checkpoint):
    llm = LLM(
        str(checkpoint("v3_moe")),
        device="cpu",
        dtype="float32",
        kv_cache_dtype="auto",
        page_size=4,
        max_model_len=96,
        max_num_seqs=8,
    )
    engine = llm.engine
    assert engine.graphs.batch_sizes == [], "no graphs on CPU by default"
    engine.graphs = CudaGraphRunner(engine.runner, SIZES, use_graphs=False)
    engine.graphs.capture()  # eager warm-up of every shape
    return engine


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 7, 8])
def test_padded_forward_equals_eager_over_page_boundaries(engine, batch_size: int) -> None:
    """Replays (here: padded eager forwards) equal unpadded eager forwards at captured sizes and
    between them, for 20 steps in which every sequence crosses pages of 4 tokens, and padded
    rows never read or write a live page (all unused pages are NaN-poisoned)."""
    poison_kv(engine)
    add_requests(engine, [5 + 3 * i for i in range(batch_size)], max_tokens=24, seed=batch_size)
    report = compare_replays(engine, steps=20, rel_tol=1e-5)
    assert report.steps == 20
    assert report.max_rel_err < 1e-5, report.max_rel_err
    assert report.argmax_mismatches == 0
    if batch_size not in SIZES:
        assert report.padded_steps == 20
    assert untouched_pages_still_poisoned(engine, report.touched_pages)
    stats = finish_requests(engine)
    assert stats.num_free_pages == stats.num_total_pages
    assert stats.num_eager_steps.get("no_graphs", 0) > 0


def test_batches_beyond_the_largest_size_and_extend_run_eagerly(engine) -> None:
    graphs = engine.graphs
    decode = HostBatch(
        ForwardMode.DECODE, [0] * 9, [5] * 9, [0] * 9, [6] * 9, [1] * 9, [[1]] * 9, []
    )
    assert graphs.padded_size(decode) is None  # 9 > 8
    decode3 = HostBatch(
        ForwardMode.DECODE, [0] * 3, [5] * 3, [0] * 3, [6] * 3, [1] * 3, [[1]] * 3, []
    )
    assert graphs.padded_size(decode3) == 4
    extend = HostBatch(ForwardMode.EXTEND, [0, 0], [0, 1], [4, 5], [2], [2], [[1]], [1])
    assert graphs.padded_size(extend) is None
    before = dict(graphs.num_eager_steps)
    graphs.run(extend)
    assert graphs.num_eager_steps["extend"] == before.get("extend", 0) + 1


def test_padding_rows_are_rewritten_every_fill() -> None:
    """A smaller batch after a larger one leaves nothing of the larger one in its padded rows."""
    bufs = InputBuffers(
        max_num_seqs=8, max_num_tokens=16, max_pages_per_seq=4, device=torch.device("cpu")
    )
    big = HostBatch(
        ForwardMode.DECODE, list(range(1, 9)), [9] * 8, list(range(100, 108)), [10] * 8, [1] * 8,
        [[1, 2, 3]] * 8, [],
    )  # fmt: skip
    bufs.fill(big, pad_to=8, max_seq_len=64, kv_pool=None, attn_backend=None)
    small = HostBatch(
        ForwardMode.DECODE, [7, 8], [3, 4], [40, 41], [4, 5], [1, 1], [[5], [6, 7]], []
    )
    batch = bufs.fill(small, pad_to=8, max_seq_len=64, kv_pool=None, attn_backend=None)
    assert batch.bs == 8 and batch.num_seqs == 2 and batch.num_tokens == 8
    assert batch.input_ids.tolist() == [7, 8, 0, 0, 0, 0, 0, 0]
    assert batch.positions.tolist() == [3, 4, 0, 0, 0, 0, 0, 0]
    assert batch.slot_mapping.tolist() == [40, 41, 0, 0, 0, 0, 0, 0]  # slot 0: dummy page 0
    assert batch.seq_lens.tolist() == [4, 5, 1, 1, 1, 1, 1, 1]
    assert batch.cu_q_lens.tolist() == list(range(9))
    assert batch.block_tables.tolist() == [[5, 0, 0, 0], [6, 7, 0, 0]] + [[0, 0, 0, 0]] * 6
    assert batch.logits_indices.tolist() == list(range(8))
    assert batch.seq_lens_host is None  # uniform batches never carry host lengths


def test_verify_padding_keeps_causal_rows_valid() -> None:
    """Padded rows of a q_len-3 batch get seq_len 3: the fewest keys a causal row may see."""
    bufs = InputBuffers(
        max_num_seqs=4, max_num_tokens=12, max_pages_per_seq=2, device=torch.device("cpu")
    )
    host = HostBatch(ForwardMode.VERIFY, [1, 2, 3], [7, 8, 9], [20, 21, 22], [10], [3], [[5]], [])
    batch = bufs.fill(host, pad_to=4, max_seq_len=64, kv_pool=None, attn_backend=None)
    assert batch.num_tokens == 12 and batch.q_len == 3
    assert batch.seq_lens.tolist() == [10, 3, 3, 3]
    assert batch.cu_q_lens.tolist() == [0, 3, 6, 9, 12]
    with pytest.raises(ValueError, match="uniform"):
        bufs.fill(
            HostBatch(
                ForwardMode.VERIFY, [1] * 5, [0] * 5, [0] * 5, [3, 2], [3, 2], [[1], [1]], []
            ),
            max_seq_len=8,
            kv_pool=None,
            attn_backend=None,
        )


def test_cuda_graph_options_are_validated() -> None:
    assert EngineConfig(device="cpu").resolved_cuda_graph() is False
    with pytest.raises(ConfigError, match="cuda_graph"):
        EngineConfig(device="cpu", cuda_graph=True).resolved_cuda_graph()
    assert EngineConfig(max_num_seqs=64).resolved_cuda_graph_batch_sizes() == (
        1, 2, 4, 8, 12, 16, 24, 32, 48, 64,
    )  # fmt: skip
    assert EngineConfig(cuda_graph_batch_sizes="8, 1,2").cuda_graph_batch_sizes == (1, 2, 8)
    with pytest.raises(ConfigError, match="cuda_graph_batch_sizes"):
        EngineConfig(max_num_seqs=4, cuda_graph_batch_sizes=(1, 8))
    with pytest.raises(ConfigError, match="cuda_graph_batch_sizes"):
        EngineConfig(cuda_graph_batch_sizes="1,x")
