"""`Fanout`: the engine requests behind one HTTP request (one per prompt and choice), and the
usage it reports: prompt tokens counted once per prompt, the prefix cache's hits per prompt, the
speculation counts summed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mlaserve.outputs import RequestMetrics
from mlaserve.service.protocol import PromptTokensDetails, SpecStatsInfo, UsageInfo
from mlaserve.service.request_stream import SubRequest

__all__ = ["Fanout"]


@dataclass(slots=True)
class Fanout:
    """The engine requests behind one HTTP request."""

    request_id: str
    prompts: list[list[int]]
    subrequests: list[SubRequest]
    created: int

    def index_of(self, engine_request_id: str) -> int:
        return int(engine_request_id.rsplit("-", 1)[1])

    def usage(
        self,
        completion_tokens: int,
        spec_metrics: Iterable[RequestMetrics] | None = None,
        cached: dict[str, int] | None = None,
    ) -> UsageInfo:
        """spec_metrics: the final metrics of every choice when the request asked for
        `return_spec_stats` (their draft/accept counts are summed), else None. cached: engine
        request id -> prompt tokens the prefix cache held for it; per prompt the fewest among
        its n choices count (prompt_tokens counts each prompt once: the one prefill paid)."""
        prompt_tokens = sum(len(p) for p in self.prompts)
        details = None
        if cached is not None:
            per_prompt: dict[int, int] = {}
            n = max(len(self.subrequests) // max(len(self.prompts), 1), 1)
            for rid, num in cached.items():
                p = self.index_of(rid) // n
                per_prompt[p] = min(per_prompt.get(p, num), num)
            details = PromptTokensDetails(cached_tokens=sum(per_prompt.values()))
        spec = None
        if spec_metrics is not None:
            ms = list(spec_metrics)
            spec = SpecStatsInfo(
                num_draft_tokens=sum(m.num_draft_tokens for m in ms),
                num_accepted_tokens=sum(m.num_accepted_tokens for m in ms),
            )
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            spec_stats=spec,
            prompt_tokens_details=details,
        )
