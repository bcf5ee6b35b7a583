"""Issue 40's crash, reproduced on purpose: a long prompt whose chunks sample nothing, on a GPU
that runs behind the host.

Steps that sample nothing have no read-back. Before the fix nothing else made the host wait on
them, so through a long prompt's chunks the host ran ahead of the device and rewrote the pinned
staging row of a step whose upload was still queued: that step then ran on a later step's
inputs (positions, KV write slots, page-table entries). On V3-lite under a benchmark load this
ended in a device-side assert; here a sleep kernel before every forward makes the device lag
by design, so the race happens every time: the greedy tokens differ from an unhindered run (or
the engine dies). With the fix each such step is waited on by a fence (overlap rule 1), the
staging rows' own fences never have to block (rule 2), and the tokens are the same.

Written against the public engine only (no module added by the fix), so the same file can be
run against the code before it: `bench/RESULTS.md` records that it fails there.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Cycles of a sleep kernel before each forward: ~20 ms at an H100's ~1.8 GHz, several host
# steps' worth of device time.
LAG_CYCLES = 36_000_000


def _lagging(run, cycles: int):
    def run_with_lag(host, *args):
        torch.cuda._sleep(cycles)
        return run(host, *args)

    return run_with_lag


def _generate(lag: bool) -> tuple[dict[str, list[int]], int, int]:
    """-> (greedy tokens per request, staging waits that blocked: input rows, sampler rows)."""
    llm = LLM(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1024, seed=0)
    engine = llm.engine
    if lag:
        engine.graphs.run_with_hidden = _lagging(engine.graphs.run_with_hidden, LAG_CYCLES)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # A prompt alone for ~15 chunks of 64 tokens that sample nothing, then beside decodes.
    engine.add_request("long", torch.randint(3, vocab, (1000,), generator=gen).tolist(), greedy)
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids  # cumulative
        steps += 1
        if steps == 20:  # mid-prompt: short requests join, decoding beside the chunks
            for i in range(4):
                prompt = torch.randint(3, vocab, (40 + 30 * i,), generator=gen).tolist()
                engine.add_request(f"short{i}", prompt, greedy)
    if hasattr(engine, "drain"):
        engine.drain()
    stats = engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages
    buffers, slots = engine.runner.buffers, engine.runner.sampling_slots
    blocked = [getattr(getattr(x, "fences", None), "num_blocking_waits", -1) for x in (buffers, slots)]  # fmt: skip
    del llm
    torch.cuda.synchronize()
    return tokens, blocked[0], blocked[1]


def test_a_lagging_device_gets_each_steps_own_inputs() -> None:
    want, _, _ = _generate(lag=False)
    got, blocked_inputs, blocked_sampler = _generate(lag=True)
    assert set(want) == {"long", "short0", "short1", "short2", "short3"}
    assert all(len(t) == 12 for t in want.values())
    assert got == want
    # Rule 1 held: no staging row ever had to wait for its copy (-1: the code before the fix).
    assert blocked_inputs == 0 and blocked_sampler == 0
