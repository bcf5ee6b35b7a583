"""Drive an engine decode step by step, comparing the graph runner's (padded) forward with a plain
eager forward of the same inputs, over NaN-poisoned KV pages.

Used by the CPU tests (the padded path run eagerly, `use_graphs=False`) and the GPU tests (real
CUDA-graph replays): one harness, so both check the same things.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from mlaserve import SamplingParams
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.llm_engine import LLMEngine

FP8_NAN_BYTE = 0x7F  # float8_e4m3fn: exponent and mantissa all ones is NaN


def poison_kv(engine: LLMEngine) -> None:
    """Fill every KV page with NaN. Pages a request owns get real values as it writes them; a
    read of anything else (stale rows, other requests' pages, padding) shows up as NaN. The
    prefix cache is reset too: its pages hold NaN now, and a case whose prompts share a prefix
    with an earlier case's must compute them, not read the poison as a hit."""
    engine.reset_prefix_cache()
    pool = engine.runner.kv_pool
    for buf in pool.kv_buffers:
        if pool.is_fp8:
            buf.view(torch.uint8).fill_(FP8_NAN_BYTE)
        else:
            buf.fill_(float("nan"))


def untouched_pages_still_poisoned(engine: LLMEngine, touched: set[int]) -> bool:
    """Pages outside `touched` (and the dummy page 0) must still hold only NaN: padded rows of a
    replayed batch wrote nowhere live."""
    pool = engine.runner.kv_pool
    others = [p for p in range(1, pool.num_pages) if p not in touched]
    if not others:
        return True
    index = torch.tensor(others, device=pool.device)
    for buf in pool.kv_buffers:
        rows = buf[index].float()
        if not torch.isnan(rows).all():
            return False
    return True


def finish_requests(engine: LLMEngine):
    """Step until every request has finished; -> the engine's stats then (callers check that
    every page came back)."""
    while engine.has_unfinished_requests():
        engine.step()
    return engine.get_stats()


@dataclass
class ReplayReport:
    steps: int = 0
    max_rel_err: float = 0.0  # max |graph - eager| / max |eager| over all steps
    rows: int = 0  # token rows compared (steps x batch)
    rows_over_tol: int = 0  # rows whose max |graph - eager| / max |eager| exceeds rel_tol
    argmax_mismatches: int = 0  # rows whose argmax differs although eager's top-2 gap is clear
    padded_steps: int = 0  # steps whose batch was padded to a larger captured size
    touched_pages: set[int] = field(default_factory=set)


def add_requests(engine: LLMEngine, prompt_lens: list[int], max_tokens: int, seed: int = 0):
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, n in enumerate(prompt_lens):
        prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
        engine.add_request(f"r{seed}-{i}", prompt, params)


@torch.inference_mode()
def compare_replays(engine: LLMEngine, steps: int, rel_tol: float) -> ReplayReport:
    """Prefill whatever is waiting (eagerly), then run `steps` decode steps. Each step's inputs
    go through the graph runner (padded to its captured size) and through a plain eager forward;
    the graph runner's logits are sampled and the engine advances on them."""
    report = ReplayReport()
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    engine.drain()  # the prefill's tokens on the host (overlap scheduling)
    runner, graphs = engine.runner, engine.graphs
    for _ in range(steps):
        sched = engine.scheduler.schedule()
        if sched.is_empty:
            break
        assert sched.mode is ForwardMode.DECODE, sched.mode
        host = runner.build_host_batch(sched)
        eager = runner.forward(runner.make_batch(host)).float().clone()
        size = graphs.padded_size(host)
        report.padded_steps += int(size is not None and size > host.num_seqs)
        replayed = graphs.run(host).float().clone()
        _score(report, replayed, eager, rel_tol)
        for s in sched.scheduled:
            report.touched_pages.update(s.request.pages)
        result = runner.sample(replayed, sched)
        engine.scheduler.after_step(sched)
        engine._postprocess(sched, result)
        report.steps += 1
    return report


@torch.inference_mode()
def compare_extends(engine: LLMEngine, rel_tol: float, all_rows: bool = True) -> ReplayReport:
    """Run the EXTEND steps of whatever is waiting (prefill chunks, mixed with the decodes of
    requests already running) through the graph runner (piecewise graphs, padded to a token
    bucket) and through a plain eager forward of every row (`logits_hidden_only` off),
    comparing the logits of every token row (`all_rows`) or of the rows the step samples; the
    engine advances on the graph runner's. Stops after the first step that is not an EXTEND
    (run normally)."""
    report = ReplayReport()
    engine.drain()
    runner, graphs = engine.runner, engine.graphs
    while True:
        sched = engine.scheduler.schedule()
        if sched.is_empty:
            break
        host = runner.build_host_batch(sched)
        if sched.mode is not ForwardMode.EXTEND:
            for s in sched.scheduled:
                report.touched_pages.update(s.request.pages)
            result = runner.sample(graphs.run(host), sched)
            engine.scheduler.after_step(sched)
            engine._postprocess(sched, result)
            break
        n_sampled = len(host.logits_indices)
        if all_rows:
            sampled = set(host.logits_indices)  # then every other row: all T rows compared
            host.logits_indices += [r for r in range(len(host.input_ids)) if r not in sampled]
        every_row = replace(host, logits_hidden_only=False)
        eager = runner.forward(runner.make_batch(every_row)).float().clone()
        bucket = graphs.piecewise.bucket_for(host)
        assert bucket is not None, f"{len(host.input_ids)} tokens: no bucket"
        report.padded_steps += int(bucket > len(host.input_ids))
        replayed = graphs.run(host).float().clone()
        _score(report, replayed, eager, rel_tol)
        for s in sched.scheduled:
            report.touched_pages.update(s.request.pages)
        result = runner.sample(replayed[:n_sampled], sched)
        engine.scheduler.after_step(sched)
        engine._postprocess(sched, result)
        report.steps += 1
    return report


def _score(report: ReplayReport, replayed: torch.Tensor, eager: torch.Tensor, rel_tol: float):
    """Add one step's logits rows (replayed vs eager) to `report`."""
    assert replayed.shape == eager.shape, (replayed.shape, eager.shape)
    assert torch.isfinite(replayed).all(), "NaN/inf in replayed logits (a poisoned page read?)"
    if eager.shape[0] == 0:  # a prefill chunk that samples nothing
        return
    row_err = (replayed - eager).abs().amax(-1) / eager.abs().max()
    report.max_rel_err = max(report.max_rel_err, row_err.max().item())
    report.rows += row_err.numel()
    report.rows_over_tol += int((row_err > rel_tol).sum().item())
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 4 * rel_tol * eager.abs().max()
    report.argmax_mismatches += int(
        ((replayed.argmax(-1) != eager.argmax(-1)) & clear).sum().item()
    )
