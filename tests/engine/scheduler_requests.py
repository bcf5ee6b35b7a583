"""Requests for the host-only scheduler tests."""

from __future__ import annotations

from mlaserve.engine.request import Request
from mlaserve.sampling_params import SamplingParams


def make(rid: str, prompt_len: int) -> Request:
    return Request(
        request_id=rid,
        prompt=None,
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=100),
        seed=0,
        max_tokens=100,
    )
