"""A test-only draft that is the target itself: it proposes the tokens the target emits without
speculation (recorded from a speculation-off run), so every draft must be accepted.

It reads accept lengths back on the host (a sync the real drafter never makes): fine for a
test fixture, whose point is to drive the verify/accept/stop machinery with full windows."""

from __future__ import annotations

import torch


class OracleDrafter:
    def __init__(self, k: int, futures: dict[tuple[int, ...], list[int]]) -> None:
        self.k = k
        self.futures = futures  # prompt ids -> the target's own continuation (long enough)

    def _next(self, request, num_outputs: int) -> list[int]:
        future = self.futures[tuple(request.prompt_token_ids)]
        window = future[num_outputs : num_outputs + self.k]
        return window + [0] * (self.k - len(window))

    def after_extend(self, sched, target, sampled, requests, draft) -> torch.Tensor | None:
        if not draft or not requests:
            return None
        rows = [self._next(r, r.num_output_tokens + 1) for r in requests]
        return torch.tensor(rows, dtype=torch.int64, device=target.hidden.device)

    def after_decode(self, target, out_tokens, accept_len, requests, draft) -> torch.Tensor | None:
        if not draft:
            return None
        lens = accept_len.tolist()
        rows = [self._next(r, r.num_output_tokens + n) for r, n in zip(requests, lens)]
        return torch.tensor(rows, dtype=torch.int64, device=target.hidden.device)
