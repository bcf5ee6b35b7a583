"""Speculative decoding: DeepSeek's MTP module as an EAGLE-style chain draft (top-1, k steps),
verified by one target forward over k+1 tokens per request; on only where it pays.

    mtp_drafter.py   the draft: MTP over prefill rows, fixed-stride draft-extend, k-1 chain steps
                     (graphed per captured batch size)
    spec_decoder.py  one engine step with speculation: verify/plain, accept, draft, one read-back
    spec_policy.py   whether the next step speculates (measured cost ratio vs accept estimate)
    step_timer.py    the start-up measurement of a speculative vs a plain engine step
    spec_stats.py    running draft/accept counts for metrics

Acceptance is `mlaserve/sampling/rejection.py` (greedy exact match, lossless rejection
sampling). Depends on engine / graph_runner / model / sampling; nothing in the engine imports
it (`llm_engine.py` composes it).
"""

from mlaserve.spec.mtp_drafter import Drafter, MTPDrafter
from mlaserve.spec.spec_decoder import SpecDecoder
from mlaserve.spec.spec_policy import Decision, SpecPolicy, StepCosts
from mlaserve.spec.spec_stats import SpecStats
from mlaserve.spec.step_timer import measure_engine_step_costs

__all__ = [
    "Decision",
    "Drafter",
    "MTPDrafter",
    "SpecDecoder",
    "SpecPolicy",
    "SpecStats",
    "StepCosts",
    "measure_engine_step_costs",
]
