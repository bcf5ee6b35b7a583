"""CUDA graphs on the GPU: replays equal eager forwards at every captured batch size and between
them, over 64 steps crossing page boundaries with NaN-poisoned unused pages; steady-state graphed
decode never synchronises with the host except the accounted token copy; the graph pool's memory
is reported.

Run on the GPU host with `python -m pytest -m gpu`; skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.kernels_adapter.flashmla import flashmla_available
from tests.graph_runner.harness import (
    add_requests,
    compare_replays,
    finish_requests,
    poison_kv,
    untouched_pages_still_poisoned,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CAPTURED = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
BETWEEN = (3, 5, 13, 33, 50)
STEPS = 64
# A padded batch may take other GEMM kernels than the unpadded eager one, so activations agree
# to bf16 rounding, not bitwise; with an fp8 cache (and fp8 queries into FlashMLA) a rounding
# flip in e4m3 (3 mantissa bits) is 6%. Measured on an H100 (2026-11-22): bf16 6.1e-3,
# fp8 4.5e-2 at worst over every size.
REL_TOL = {"bf16": 2e-2, "fp8_e4m3": 8e-2}
# A padded replay groups the padding rows' tokens with the real ones in the MoE expert GEMMs,
# so expert groups change size and a real row's accumulation order may too: a router near-tie
# in the next layer can then flip one token's experts. Measured on an H100 (flashmla bf16, bs 33
# padded to 48, 64 steps): 3 of 2112 rows differed at all, one by 3.5e-2 of the max logit, its
# argmax unchanged; every captured size and bs 3/5/13 were bit-identical. Hence: at most
# MAX_ROWS_OVER_TOL of the rows beyond REL_TOL, and no argmax change where the top-2 gap is clear.
MAX_ROWS_OVER_TOL = 0.01


def graphed_llm(
    backend: str, kv_cache_dtype: str, model: str | None = None, max_model_len: int = 1024
) -> LLM:
    return LLM(
        model,
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        attention_backend=backend,
        max_num_seqs=64,
        max_model_len=max_model_len,
        cuda_graph=True,
    )


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["flashmla", "reference"])
def test_replay_equals_eager_at_every_size(checkpoint, backend: str, kv_cache_dtype: str) -> None:
    if backend == "flashmla" and not flashmla_available():
        pytest.skip("flashmla needs an SM90 GPU and sgl-flash-mla")
    # FlashMLA needs DeepSeek's 512/64 latent dims: the shipped default model has them.
    model = None if backend == "flashmla" else str(checkpoint("v3_moe"))
    engine = graphed_llm(backend, kv_cache_dtype, model, 1024 if model is None else 256).engine
    assert engine.graphs.batch_sizes == list(CAPTURED)
    assert len(engine.graphs.graphs) == len(CAPTURED)
    sizes = CAPTURED + BETWEEN if backend == "flashmla" else (1, 3, 8, 13, 64)
    worst = 0.0
    errors: dict[int, float] = {}
    for bs in sizes:
        poison_kv(engine)
        # Prompts of 30..93 tokens: every sequence crosses a 64-token page during the 64 steps.
        lens = [30 + (7 * i) % 64 for i in range(bs)]
        if model is not None:  # the tiny checkpoint's 256 positions
            lens = [n // 2 for n in lens]
        add_requests(engine, lens, max_tokens=STEPS + 1, seed=bs)
        replays_before = engine.graphs.num_replays
        tol = REL_TOL[kv_cache_dtype]
        report = compare_replays(engine, steps=STEPS, rel_tol=tol)
        assert report.steps == STEPS
        assert engine.graphs.num_replays - replays_before == STEPS, "every step replayed"
        errors[bs] = report.max_rel_err
        assert report.rows_over_tol <= MAX_ROWS_OVER_TOL * report.rows, (bs, report)
        assert report.argmax_mismatches == 0, bs
        assert untouched_pages_still_poisoned(engine, report.touched_pages), bs
        worst = max(worst, report.max_rel_err)
        stats = finish_requests(engine)
        assert stats.num_free_pages == stats.num_total_pages
    print(
        f"{backend}/{kv_cache_dtype}: max relative logit error graph vs eager {worst:.2e}; per "
        f"batch size {', '.join(f'{bs}: {e:.1e}' for bs, e in errors.items())}"
    )
    assert engine.compile_watch.compiles_since_ready == 0


def test_steady_state_graphed_decode_never_syncs() -> None:
    """A whole engine step of graphed decode (build inputs, replay, sample greedily, read the
    tokens back) raises nothing under sync debug mode "error"; the one wait is the accounted
    token copy (an event on a pinned non-blocking copy, which that mode does not see, so the
    runner counts its waits: exactly one per step)."""
    if not flashmla_available():
        pytest.skip("flashmla needs an SM90 GPU and sgl-flash-mla")
    engine = graphed_llm("flashmla", "fp8_e4m3").engine
    add_requests(engine, [40, 50, 60], max_tokens=40)
    for _ in range(3):
        engine.step()  # prefill (eager) and a first decode
    waits = engine.runner.num_host_waits
    replays = engine.graphs.num_replays
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            outputs = engine.step()
            assert len(outputs) == 3
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.graphs.num_replays - replays == 8
    assert engine.runner.num_host_waits - waits == 8


def test_a_greedy_decode_step_runs_three_ops_outside_its_graph(monkeypatch) -> None:
    """A steady all-greedy decode step splits its inputs and samples inside its DECODE graph:
    outside it only the staging row's upload, the previous tokens into that row, and the
    read-back run (no split, argmax, finite check or `where`, no steps upload, no Triton
    launch), and the tokens read back are the argmax of the graph's logits. Three requests
    replay in the bs-4 graph, so a padded row is there too."""
    from mlaserve.engine.forward_batch import ForwardMode
    from mlaserve.sampling import sampler
    from tests.device_ops import DeviceOps

    engine = graphed_llm("reference", "bf16").engine
    add_requests(engine, [40, 50, 60], max_tokens=40)
    for _ in range(4):
        engine.step()
    launches = []
    monkeypatch.setattr(sampler, "fused_argmax", lambda x: launches.append(x) or (None, None))
    with DeviceOps() as counted:
        outputs = engine.step()
    assert len(outputs) == 3 and launches == []
    # the staging row up, the previous tokens into it, the read-back (no page is appended)
    assert dict(counted.ops) == {"copy_": 3}
    logits = engine.graphs.graphs[(ForwardMode.DECODE, 1, 4)].logits[:3]
    expected = logits.argmax(dim=-1).tolist()
    pending = engine._inflight
    assert pending is not None and pending.sample.read_back.wait() == expected
    monkeypatch.undo()
    while engine.has_unfinished_requests():
        engine.step()


def test_graph_memory_is_reported(caplog) -> None:
    if not flashmla_available():
        pytest.skip("flashmla needs an SM90 GPU and sgl-flash-mla")
    with caplog.at_level("INFO"):
        llm = graphed_llm("flashmla", "fp8_e4m3")
    report = llm.engine.graph_report
    assert report is not None and report.num_graphs == len(CAPTURED)
    print(
        f"graph pool: {report.pool_bytes / 2**20:.1f} MiB for {report.num_graphs} graphs; "
        f"capture {report.capture_s:.2f} s, warm-up {report.warmup_s:.2f} s"
    )
    # The allocator's reserved growth during capture: 114 MiB for the V2-Lite shape on an H100,
    # 0 for this small model, whose graphs fit in segments the warm-up had already reserved.
    assert 0 <= report.pool_bytes < 2**30
    assert any("graph pool" in r.getMessage() for r in caplog.records)
    # the phase line (StartupTimes.describe) and the graphs' line
    assert any(" to ready: " in r.getMessage() and "capture" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert any(r.getMessage().startswith("start-up: ") and "CUDA graphs" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_graphs_off_runs_eagerly() -> None:
    if not flashmla_available():
        pytest.skip("flashmla needs an SM90 GPU and sgl-flash-mla")
    llm = LLM(device="cuda", cuda_graph=False, max_model_len=256)
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 8
    stats = llm.engine.get_stats()
    assert stats.num_graph_replays == 0 and stats.num_eager_steps["graphs_off"] >= 7


def test_released_graphs_leave_an_engine_that_runs_eagerly_to_the_same_tokens() -> None:
    """`LLMEngine.release_graphs` (the shutdown's first act under TP, since a graph that holds
    NCCL collectives hangs the group's teardown) destroys every graph; the engine still serves."""
    if not flashmla_available():
        pytest.skip("flashmla needs an SM90 GPU and sgl-flash-mla")
    llm = LLM(device="cuda", max_model_len=256, num_speculative_tokens=2)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["def f(x):", "import os\n"]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    engine = llm.engine
    assert engine.graphs.graphs and engine.spec_decoder.drafter.graphs
    replays = engine.get_stats().num_graph_replays
    engine.release_graphs()
    assert not engine.graphs.graphs and not engine.spec_decoder.drafter.graphs
    assert engine.graphs.piecewise is None or not engine.graphs.piecewise._buckets
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert engine.get_stats().num_graph_replays == replays  # no graph left to replay
    assert after == before
