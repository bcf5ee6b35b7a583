"""The CUDA-graph contract of the preallocated input buffers, proven with a real capture.

A DECODE forward (attention-backend `prepare` + model + logits) is captured once against the
runner's buffers with `max_seq_len = max_model_len`, then replayed for several decode steps after
each step's inputs are copied into the same buffers. Every replay must give the logits an eager
forward gives for the same step, and the greedy tokens must follow the eager engine's. This is
what the graph runner will rely on: no per-step host reads, no storage that moves.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.kernels_adapter.flashmla import flashmla_available
from tests.engine.greedy_oracle import prompts_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BS, STEPS = 4, 6


def start(model: str | None, kv_cache_dtype: str, backend: str):
    llm = LLM(
        model,
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=128,
        attention_backend=backend,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=STEPS + 2, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts_for(engine.model_config.vocab_size)[:BS]):
        engine.add_request(str(i), p, params)
    engine.step()  # prefill (eager, ragged)
    engine.drain()  # its tokens on the host (overlap scheduling keeps them on the device)
    return engine


def decode_batch(engine):
    """Schedule one decode step and copy its inputs into the runner's buffers."""
    scheduled = engine.scheduler.schedule()
    assert [s.num_new_tokens for s in scheduled.scheduled] == [1] * BS
    runner = engine.runner
    host = runner.build_host_batch(scheduled)
    # A graph's fixed bound on seq_lens, never read from the GPU.
    batch = runner.make_batch(host, max_seq_len=runner.max_model_len)
    assert batch.mode is ForwardMode.DECODE
    return scheduled, batch


def advance(engine, scheduled, logits) -> list[int]:
    tokens = logits.argmax(dim=-1).tolist()
    engine.scheduler.after_step(scheduled)
    for s, t in zip(scheduled.scheduled, tokens):
        s.request.output_token_ids.append(t)
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["reference", "flashmla"])
def test_decode_graph_replays_match_eager(checkpoint, kv_cache_dtype: str, backend: str) -> None:
    if backend == "flashmla" and not flashmla_available():
        pytest.skip("flashmla needs an SM90 GPU and sgl-flash-mla")
    # FlashMLA needs DeepSeek's 512/64 latent dims: the shipped default model has them.
    model = None if backend == "flashmla" else str(checkpoint("v3_moe"))
    eager_engine = start(model, kv_cache_dtype, backend)
    graph_engine = start(model, kv_cache_dtype, backend)
    assert graph_engine.runner.attn_backend.name == backend
    runner = graph_engine.runner

    scheduled, batch = decode_batch(graph_engine)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        runner.forward(batch)  # warm-up outside the graph (allocator, lazy inits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = runner.forward(batch)

    for step in range(STEPS):
        if step > 0:
            scheduled, batch = decode_batch(graph_engine)
        graph.replay()
        replayed = static_logits.clone()
        eager = runner.forward(batch)  # same inputs, same KV writes: must agree
        torch.testing.assert_close(replayed, eager, rtol=1e-3, atol=1e-3)
        got = advance(graph_engine, scheduled, replayed)

        e_scheduled, e_batch = decode_batch(eager_engine)
        want = advance(eager_engine, e_scheduled, eager_engine.runner.forward(e_batch))
        assert got == want, f"step {step}"
