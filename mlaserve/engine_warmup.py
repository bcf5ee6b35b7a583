"""An `LLMEngine`'s life outside serving: the warm-up before it serves (every lazy compile and
allocation, the CUDA graphs' capture, the MTP draft's graphs and measured step costs, the
start-up times' end), and the release of its graphs before it stops.

Functions of the engine, kept out of llm_engine.py so that the step loop reads on its own; they
take the engine as it is (duck-typed: importing `LLMEngine` here would be a cycle).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from mlaserve.engine.model_runner import WARM_UP_PROMPT_LEN
from mlaserve.sampling_params import SamplingParams
from mlaserve.spec import MTPDrafter, measure_engine_step_costs

__all__ = ["release_graphs", "warm_up"]

logger = logging.getLogger("mlaserve.llm_engine")  # the start-up lines under the engine's name


def warm_up(engine: Any) -> None:
    """A throwaway request (prefill + decode + sampling), then every graph shape eagerly and its
    capture. Ends the start-up times (`engine.startup`) and logs them, phase by phase."""
    engine.runner.wait_kernel_compiles()  # its own phase (kernel_warmup)
    t0 = time.perf_counter()
    prompt_len = min(WARM_UP_PROMPT_LEN, engine.model_config.vocab_size, engine.max_model_len - 2)
    prompt = list(range(prompt_len))
    engine.add_request("__warmup__", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.requests.get("__warmup__") is not None:
        engine.step()
    engine.drain()
    t1 = time.perf_counter()
    if engine.spec_decoder is not None:
        engine.spec_decoder.reset_stats()  # the throwaway request is not served traffic
    if engine.allocator.cache is not None:  # nor are its cached pages and counts
        engine.allocator.reset_cache()
        engine.allocator.cache.reset_stats()
    # Capture runs collectives with the workers outside a step: watched like one.
    workers = engine.tp_workers
    with contextlib.nullcontext() if workers is None else workers.busy():
        report = engine.graphs.capture() if engine.graphs.batch_sizes else None
        if engine.spec_decoder is not None and report is not None:
            _capture_spec(engine)
    # Graphs off: nothing joined the background kernel warm-up yet (graphs on: the capture did).
    waited = engine.runner.join_kernel_warm_up()  # start-up's kernel_warmup phase
    t2 = time.perf_counter()
    engine.graph_report = report
    pw = report.piecewise if report else None
    # The graphs' eager runs before their capture are warm-up (they compile); the rest of the
    # block (capture, the MTP draft's graphs and step costs) is capture, less the wait for the
    # kernel warm-up (its own phase).
    eager_s = report.warmup_s + (pw.warmup_s if pw else 0.0) if report else 0.0
    waited += report.kernel_warm_up_wait_s if report else 0.0
    eager_s = min(eager_s, max(0.0, t2 - t1 - waited))
    engine.startup.add("warmup", t1 - t0 + eager_s)
    engine.startup.add("capture", max(0.0, t2 - t1 - eager_s - waited))
    engine.compile_watch.record_build(cache_hit=False, count=engine.runner.process_compiles)
    engine.compile_watch.mark_ready()
    engine.startup.mark_ready(num_compiles=engine.compile_watch.compiled)
    logger.info("%s", engine.startup.describe())
    logger.info(
        "start-up: %s",
        f"{report.num_graphs} CUDA graphs"
        + (f" + {pw.num_graphs} prefill pieces" if pw else "")
        + f", pools {(report.pool_bytes + (pw.pool_bytes if pw else 0)) / 2**20:.1f} MiB"
        if report
        else "CUDA graphs off",
    )
    if engine.spec_decoder is not None:
        logger.info(
            "speculative decoding: MTP chain draft, k=%d (verify q_len %d)",
            engine.spec_decoder.k,
            engine.spec_decoder.k + 1,
        )


def _capture_spec(engine: Any) -> None:
    """The draft's graphs (after, and into the pool of, the target's), then the measured step
    costs the policy decides from."""
    dec = engine.spec_decoder
    if dec is None or not isinstance(dec.drafter, MTPDrafter):
        return
    t0 = time.perf_counter()
    num = dec.drafter.capture(engine.graphs, (1, dec.k + 1))
    t1 = time.perf_counter()
    costs = measure_engine_step_costs(engine)
    dec.reset_stats()  # the measurement's requests are not served traffic
    dec.policy.costs = costs
    engine.spec_costs = costs
    logger.info(
        "speculative decoding: %d draft graphs in %.2f s; break-even accept length per batch "
        "size (speculative / plain engine step, wall time): %s; draft-cache refresh overhead: "
        "%s; prior %.2f",
        num,
        t1 - t0,
        {b: round(costs.break_even(b), 2) for b in costs.plain_s} if costs else "unmeasured",
        {b: f"{costs.refresh_overhead(b):+.1%}" for b in costs.plain_s} if costs else "-",
        dec.policy.prior,
    )


def release_graphs(engine: Any) -> None:
    """Destroy every CUDA graph `engine` captured (target, draft, prefill pieces) once the device
    is done with them; later steps run eagerly. Under TP this comes before the group is left: a
    graph holding NCCL collectives blocks the communicator's teardown (pytorch/pytorch#115388)."""
    if engine.spec_decoder is not None and isinstance(engine.spec_decoder.drafter, MTPDrafter):
        engine.spec_decoder.drafter.release()
    engine.graphs.release()
