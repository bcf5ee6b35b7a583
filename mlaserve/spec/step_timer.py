"""Start-up measurement of what one speculative step and one plain step cost, per captured batch
size, from the CUDA graphs the decoder replays (what `SpecPolicy` decides from).

A plain step: the DECODE graph, an argmax over its logits (the greedy sampler) and the draft's
one-row DRAFT_EXTEND graph (its cache update). A speculative step: the VERIFY graph (k+1 rows
per request), an argmax over its logits (greedy acceptance's one pass over [bs*(k+1), V]), the
(k+1)-row DRAFT_EXTEND graph and the DRAFT graph (k tokens). Inputs are the padding rows the
capture used (short contexts): both steps read the same weights, and at long contexts the
attention share grows alike for both (k+1 query rows share one KV read per request).

Device time between CUDA events, median of `iters` back-to-back runs after one warm run.
"""

from __future__ import annotations

import statistics

import torch

from mlaserve.graph_runner import CudaGraphRunner
from mlaserve.spec.mtp_drafter import MTPDrafter, target_mode
from mlaserve.spec.spec_policy import StepCosts

__all__ = ["measure_step_costs", "time_replays"]


def time_replays(fn, iters: int) -> float:
    """Median seconds of `fn()` on the current stream (one warm run first)."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def step_fns(graphs: CudaGraphRunner, drafter: MTPDrafter, k: int, size: int):
    """(plain step, speculative step) at a captured size, as replays of the captured graphs."""

    def replay(q: int) -> torch.Tensor:
        entry = graphs.graphs[(target_mode(q), q, size)]
        graphs.dummy_batch(target_mode(q), q, size)  # padding rows into the input buffers
        entry.graph.replay()
        return entry.logits

    drafter.reset_accept()

    def plain() -> None:
        replay(1).argmax(dim=-1)
        drafter.graphs[("extend", 1, size)].graph.replay()

    def spec() -> None:
        replay(k + 1).argmax(dim=-1)
        drafter.graphs[("extend", k + 1, size)].graph.replay()
        drafter.graphs[("draft", 1, size)].graph.replay()

    return plain, spec


def measure_step_costs(
    graphs: CudaGraphRunner, drafter: MTPDrafter, k: int, iters: int = 10
) -> StepCosts | None:
    """None without captured graphs (nothing to measure)."""
    if not graphs.use_graphs or not drafter.graphs:
        return None
    plain_s, spec_s = {}, {}
    for size in graphs.batch_sizes:
        plain, spec = step_fns(graphs, drafter, k, size)
        plain_s[size] = time_replays(plain, iters)
        spec_s[size] = time_replays(spec, iters)
    return StepCosts(plain_s=plain_s, spec_s=spec_s)
