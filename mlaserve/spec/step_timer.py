"""What one speculative step and one plain step cost, per captured batch size (what `SpecPolicy`
decides from).

`measure_engine_step_costs` (start-up): the wall time of real engine steps, host work included
(batch building, acceptance, the read-back), on throwaway requests with short prompts: per
captured size, `rounds` rounds of `steps` decode steps with every decision forced to speculate,
then `steps` plain steps that refresh the draft caches, then `steps` plain steps with no draft
work (after two steps each to settle: drafts are made one step ahead), the lower quartile of
each kind's steps over its rounds (timing noise only adds time, as the policy's served costs
assume). Interleaved rounds, because a speculating engine never observes a plain step while
serving, so a noisy plain figure sets its break-even for good. (A start-up bias of the plain
figure remains, cause not found: bench/RESULTS.md, "Moved from mlaserve/spec/step_timer.py".)
On a small model the host work is a large share of a step, which device time alone would
miss. These are the policy's starting point; it follows the served steps' own wall times from
there.

`replay_step_times` / `time_replays` (bench/spec.py): device time of the graphs alone, on
the input buffers a real engine step left: `size` requests with distinct random prompts are
prefilled and decoded through `LLMEngine.step()` with the policy forced (speculating, then
plain), and each kind's graphs are replayed right after a real step of that kind. So every row
is a different token at its own position, and a MoE layer routes each row on its own (padding
rows, all token 0 at position 0, route every row alike, and a plain step then read far fewer
experts and looked much cheaper than it is). A plain step: the DECODE graph,
whose own argmax is the greedy sampler's work. A speculative step: the VERIFY graph on the
requests' next VERIFY rows (each one's last token and its k drafts), the argmax over its logits
(greedy acceptance's `row_argmax` over [bs*(k+1), V]), the (k+1)-row DRAFT_EXTEND graph on those
argmax tokens (what greedy acceptance emits), and the DRAFT graph (k tokens). Replays are
idempotent: no graph writes the buffers it reads (the input ids are set again each time; the KV
rows they write are rewritten alike).

Device time between CUDA events, median of `iters` back-to-back runs after one warm run.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Any

import torch

from mlaserve.sampling.argmax_kernel import row_argmax
from mlaserve.spec.mtp_drafter import target_mode
from mlaserve.spec.spec_policy import (
    FORCED_PLAIN,
    FORCED_REFRESH,
    FORCED_SPEC,
    StepCosts,
    lower_quartile,
)

__all__ = ["measurable_sizes", "measure_engine_step_costs", "replay_step_times", "time_replays"]

PROMPT_TOKENS = 8  # each throwaway request's prompt in the engine step measurement


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


def replay_step_times(engine: Any, size: int, iters: int, prompt_len: int = 64) -> dict:
    """Device seconds of a plain and a speculative step's graphs at captured size `size`, on
    real rows (module doc). engine: an `LLMEngine` with a speculative decoder, captured graphs
    and no requests. -> {"decode", "spec", "draft" (the DRAFT graph: all k drafts),
    "draft_extend"}."""
    dec = engine.spec_decoder
    graphs, drafter, k = engine.graphs, dec.drafter, dec.k
    if not graphs.use_graphs or size not in graphs.batch_sizes:
        raise ValueError(f"replay_step_times: no captured graphs of batch size {size}")
    if engine.runner.tp.size > 1:  # a replay here would wait for workers that never replay it
        raise ValueError(
            "replay_step_times: replays graphs on rank 0 alone; use tensor_parallel_size 1"
        )
    from mlaserve.sampling_params import SamplingParams  # the request API, not the engine's

    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(size)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = [torch.randint(2, vocab, (prompt_len,), generator=g).tolist() for _ in range(size)]
    policy, times = dec.policy, {}

    def replay(q: int) -> torch.Tensor:
        entry = graphs.graphs[(target_mode(q), q, size)]
        entry.graph.replay()
        return entry.logits

    def extend() -> None:
        drafter.graphs[("extend", k + 1, size)].graph.replay()

    def draft() -> None:
        drafter.graphs[("draft", 1, size)].graph.replay()

    ids_buf, rows = engine.runner.buffers.input_ids, size * (k + 1)

    def spec() -> None:
        ids_buf[:rows].copy_(verify_ids)  # the VERIFY rows: [last token, d_1..d_k] per request
        emitted = row_argmax(replay(k + 1))  # greedy acceptance's one pass over the logits
        ids_buf[:rows].copy_(emitted)  # the emitted tokens are the draft-extend's inputs
        extend()
        draft()

    with _throwaway_requests(engine, f"replay_{size}", prompts, params) as ids:
        policy.forced = FORCED_SPEC
        _prefill(engine, ids)
        for _ in range(2):
            engine.step()  # verify steps; each request now holds k drafts
        # A step's draft-extend overwrites the VERIFY rows' ids with the tokens it emitted
        # (`after_decode`), and a random-weight model emits one token over and over: rows of
        # one repeated token route alike (the VERIFY graph then timed faster than on the rows it
        # really verifies). So the requests' next VERIFY batch
        # is built and run as a step would, and its ids are what the VERIFY graph is timed on.
        graphs.run_with_hidden(dec._verify_batch([engine.requests[rid] for rid in ids]))
        verify_ids = ids_buf[:rows].clone()
        times["spec"] = time_replays(spec, iters)
        times["draft_extend"] = time_replays(extend, iters)
        times["draft"] = time_replays(draft, iters)
        policy.forced = FORCED_PLAIN
        for _ in range(2):
            engine.step()  # the first still verifies the drafts it holds; then plain
        times["decode"] = time_replays(lambda: replay(1), iters)  # (the graph samples)
    return times


@contextmanager
def _throwaway_requests(engine: Any, tag: str, prompts: list[list[int]], params: Any):
    """Admit one request per prompt (ids `__{tag}_{i}`); on leaving, abort them all, resolve the
    step still in flight (overlapped plain steps: served traffic must not start with a throwaway
    step's read-back) and let the policy decide again (`forced` back to None), whatever
    happened inside."""
    ids = [f"__{tag}_{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    try:
        yield ids
    finally:
        engine.spec_decoder.policy.forced = None
        for rid in ids:
            engine.abort_request(rid)
        engine.drain()


def _prefill(engine: Any, ids: list[str]) -> None:
    """Step until every request in `ids` has its first token (its prompt done, in chunks or
    not, and with it the draft's pass over the prompt)."""
    while any(engine.requests[rid].num_output_tokens == 0 for rid in ids):
        engine.step()


def measurable_sizes(engine: Any, max_tokens: int) -> list[int]:
    """The captured batch sizes whose throwaway requests (PROMPT_TOKENS + `max_tokens` each)
    all fit in the KV pool at once, whole: in a smaller pool some would finish before the last
    one started (a `--num-pages 64` server's start-up failed on that), and the steps timed would
    not be of that batch size. Larger batches then go unmeasured (`StepCosts.size_for`)."""
    scheduler = engine.scheduler
    per_request = scheduler.num_pages_for(
        PROMPT_TOKENS + max_tokens + scheduler.num_lookahead_tokens
    )
    fits = min(engine.config.max_num_seqs, engine.allocator.num_usable_pages // per_request)
    return [b for b in engine.graphs.batch_sizes if b <= fits]


def measure_engine_step_costs(engine: Any, steps: int = 10, rounds: int = 5) -> StepCosts | None:
    """engine: an `LLMEngine` with a speculative decoder and captured graphs (typed loosely:
    the engine composes this package, not the other way round). Runs throwaway requests to
    completion of the measurement, then aborts them. None without graphs."""
    dec = engine.spec_decoder
    if dec is None or not engine.graphs.use_graphs:
        return None
    from mlaserve.sampling_params import SamplingParams  # the request API, not the engine's

    vocab = engine.model_config.vocab_size
    params = SamplingParams(
        max_tokens=4 * steps * (dec.k + 1) + 8, temperature=0.0, ignore_eos=True
    )
    sizes = measurable_sizes(engine, params.max_tokens)
    if not sizes:
        return None
    policy = dec.policy
    times: dict[str, dict[int, list[float]]] = {"spec": {}, "refresh": {}, "plain": {}}
    # Spec first and plain last in a round: a plain step without draft work leaves the caches
    # stale, and the next round's prefill-free spec steps need them whole, so each round
    # starts from fresh requests.
    kinds = ((FORCED_SPEC, "spec"), (FORCED_REFRESH, "refresh"), (FORCED_PLAIN, "plain"))
    for size in sizes:
        for r in range(rounds):
            prompts = [
                [(31 * i + 7 * j + 3 * r) % vocab for j in range(PROMPT_TOKENS)]
                for i in range(size)
            ]
            with _throwaway_requests(engine, f"spec_cost_{size}_{r}", prompts, params) as ids:
                for forced, kind in kinds:
                    policy.forced = forced
                    _prefill(engine, ids)  # (the first kind's steps only)
                    for _ in range(2):
                        engine.step()
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        engine.step()
                        times[kind].setdefault(size, []).append(time.perf_counter() - t0)
    plain_s, spec_s, refresh_s = (
        {b: lower_quartile(t) for b, t in times[kind].items()}
        for kind in ("plain", "spec", "refresh")
    )
    return StepCosts(plain_s=plain_s, spec_s=spec_s, refresh_s=refresh_s)
