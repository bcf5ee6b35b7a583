"""An EXTEND batch whose readers want only its logits rows (`ForwardBatch.logits_hidden_only`)
runs the last layer's o_proj and FFN on those rows alone: same logits as a forward of every row,
the same KV written in every layer, and only an engine without a draft model builds such batches.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.engine.forward_batch import ForwardMode

PROMPT = 40


# fp32 on the CPU; bf16 on a GPU, where the last layer's few rows take the decode-sized kernels
# (GEMV, MoE decode) instead of the prefill ones: bf16 rounding apart
DEVICES = {
    "cpu": ("float32", 1e-5),
    "cuda": ("bfloat16", 2e-2),
}


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def engine(checkpoint, request):
    llm = LLM(
        str(checkpoint("v3_moe")),
        device=request.param,
        dtype=DEVICES[request.param][0],
        kv_cache_dtype="auto",
        page_size=4 if request.param == "cpu" else 64,
        max_model_len=160,
        max_num_batched_tokens=64,
        cuda_graph=False,
    )
    return llm.engine


def _rows_seen(module: torch.nn.Module, seen: list[int]):
    return module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[0]))


@torch.inference_mode()
def _forward(engine, host):
    """-> (logits, hidden, every KV layer's rows of the host batch's slots, cloned). Those rows
    are NaN before the forward: what it does not write shows."""
    runner = engine.runner
    slots = torch.tensor(host.slot_mapping, device=runner.device)
    for buf in runner.kv_pool.kv_buffers:
        buf.view(-1, buf.shape[-1]).index_fill_(0, slots, float("nan"))
    batch = runner.make_batch(host)
    logits, hidden = runner.forward_with_hidden(batch)
    kv = [buf.view(-1, buf.shape[-1])[slots].clone() for buf in runner.kv_pool.kv_buffers]
    return logits.clone(), hidden.clone(), kv


@pytest.mark.parametrize("logits_rows", [[PROMPT - 1], [3, 17, PROMPT - 1], []])
def test_last_layer_runs_on_the_logits_rows_alone(engine, logits_rows: list[int]) -> None:
    g = torch.Generator().manual_seed(len(logits_rows))
    prompt = torch.randint(0, engine.model_config.vocab_size, (PROMPT,), generator=g).tolist()
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    try:
        host = engine.runner.build_host_batch(engine.scheduler.schedule())
        assert host.mode is ForwardMode.EXTEND and host.logits_hidden_only
        host.logits_indices = list(logits_rows)
        model = engine.runner.model.model
        first, last = [], []
        hooks = [_rows_seen(model.layers[0].mlp, first), _rows_seen(model.layers[-1].mlp, last)]
        try:
            every = _forward(engine, replace(host, logits_hidden_only=False))
            assert first == last == [PROMPT]
            first.clear(), last.clear()
            only = _forward(engine, host)
        finally:
            for h in hooks:
                h.remove()
    finally:
        engine.abort_request("r")
    n = len(logits_rows)
    assert first == [PROMPT] and last == [n], (first, last)
    logits, hidden, kv = only
    assert hidden.shape == (n, engine.model_config.hidden_size)
    assert every[1].shape[0] == PROMPT
    assert logits.shape == every[0].shape == (n, engine.model_config.vocab_size)
    tol = DEVICES[logits.device.type][1]
    if n:
        err = (logits - every[0]).abs().max() / every[0].abs().max()
        assert err < tol, err
        want = every[1][logits_rows].float()
        assert ((hidden.float() - want).abs().max() / want.abs().max()) < tol
    # every layer's KV, the last one's included, is written for every row, as before
    assert all(torch.isfinite(a).all() for a in every[2])
    assert all(torch.equal(a, b) for a, b in zip(kv, every[2], strict=True))


def test_only_extend_batches_prune(engine) -> None:
    runner = engine.runner
    assert not runner.draft_reads_hidden
    engine.add_request("d", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    try:
        extend = runner.make_batch(runner.build_host_batch(engine.scheduler.schedule()))
    finally:
        engine.abort_request("d")
    assert extend.mode is ForwardMode.EXTEND and extend.logits_hidden_only
    one = {"mode": ForwardMode.DECODE, "q_len": 1, "num_tokens": 1}
    assert not replace(extend, **one, logits_hidden_only=False).logits_hidden_only
    with pytest.raises(ValueError, match="logits_hidden_only is for EXTEND"):
        replace(extend, **one)


def test_a_draft_reading_hidden_states_keeps_every_row() -> None:
    llm = LLM(device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    engine = llm.engine
    assert engine.runner.draft_reads_hidden
    engine.add_request("s", [1, 2, 3, 4], SamplingParams(max_tokens=1, temperature=0.0))
    try:
        host = engine.runner.build_host_batch(engine.scheduler.schedule())
    finally:
        engine.abort_request("s")
    assert host.mode is ForwardMode.EXTEND and not host.logits_hidden_only
