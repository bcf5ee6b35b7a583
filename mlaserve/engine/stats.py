"""`EngineStats`: the engine's counters at one moment, what the metrics layer reads.

Plain data (picklable: the engine process sends it to the server process)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["STEP_HISTORY", "EngineStats"]

STEP_HISTORY = 4096  # steps whose token counts EngineStats carries


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_total_pages: int
    # Running totals since start-up (the metrics layer turns them into counters).
    num_graph_replays: int = 0
    num_piecewise_replays: int = 0  # EXTEND forwards from piecewise graphs
    num_eager_steps: dict[str, int] = field(default_factory=dict)  # by reason
    num_compiles_while_serving: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    # Tokens (prompt + generated) each of the last steps ran, newest last, at most
    # STEP_HISTORY of them: whoever reads stats less often than every step (the engine process
    # sends them every STATS_INTERVAL_S) still sees every step since its last read.
    recent_step_num_tokens: tuple[int, ...] = ()
    # Speculative decoding running totals (zero when it is off): verify steps (one per request
    # per step), draft tokens proposed, accepted drafts per draft position, and how many verify
    # steps emitted n tokens (bonus included).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_accept_lengths: dict[int, int] = field(default_factory=dict)
    # The policy's per-step decisions ("on:pays", "off:cap", ... -> steps) and its running
    # accept-length estimate (what it compares with the measured break-even).
    spec_decisions: dict[str, int] = field(default_factory=dict)
    spec_accept_length_estimate: float = 0.0
    # The policy's current break-even accept length per captured batch size (its costs follow
    # the served steps); empty while unmeasured (CPU, graphs off).
    spec_break_even: dict[int, float] = field(default_factory=dict)
    # Start-up: seconds per phase and "other" (`StartupTimes.phase_seconds`), summing to the
    # process's age when the engine became ready; empty before that.
    startup_seconds: dict[str, float] = field(default_factory=dict)
    # Prefix caching running totals (zero when it is off; vLLM's semantics): prompt tokens
    # looked up at admission, and how many of them the cache held.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_pages / max(self.num_total_pages, 1)
