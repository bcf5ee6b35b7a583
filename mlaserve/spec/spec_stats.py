"""Running totals of speculative decoding (the metrics layer turns them into counters)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["SpecStats"]


@dataclass
class SpecStats:
    k: int
    num_drafts: int = 0  # verify steps, one per request per step
    num_draft_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]
    accept_lengths: Counter[int] = field(default_factory=Counter)  # tokens emitted -> steps

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def record(self, accept_lens: list[int]) -> None:
        """accept_lens: tokens emitted per verified request (1..k+1)."""
        for n in accept_lens:
            self.num_drafts += 1
            self.num_draft_tokens += self.k
            self.accept_lengths[n] += 1
            for pos in range(n - 1):
                self.accepted_per_pos[pos] += 1

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_per_pos)

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verify step, bonus included (1.0 when nothing was accepted)."""
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)
