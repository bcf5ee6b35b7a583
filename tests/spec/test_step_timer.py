"""The start-up step-cost measurement measures only batch sizes whose throwaway requests all fit
in the KV pool at once (a server started with `--num-pages 64` and speculation failed its start
before: at batch size 64 a throwaway request finished before the last one started)."""

from __future__ import annotations

from types import SimpleNamespace

from mlaserve.kv_cache import PageAllocator
from mlaserve.spec.step_timer import PROMPT_TOKENS, measurable_sizes


def _engine(num_pages: int, max_num_seqs: int = 64, lookahead: int = 3):
    scheduler = SimpleNamespace(num_lookahead_tokens=lookahead, num_pages_for=lambda n: -(-n // 64))
    return SimpleNamespace(
        scheduler=scheduler,
        allocator=PageAllocator(num_pages),
        config=SimpleNamespace(max_num_seqs=max_num_seqs),
        graphs=SimpleNamespace(batch_sizes=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64]),
    )


def test_sizes_whose_requests_do_not_all_fit_are_not_measured() -> None:
    max_tokens = 168  # k = 3's throwaway requests: 8 + 168 + 3 tokens, 3 pages of 64
    assert -(-(PROMPT_TOKENS + max_tokens + 3) // 64) == 3
    assert measurable_sizes(_engine(num_pages=64), max_tokens) == [1, 2, 4, 8, 12, 16]
    assert measurable_sizes(_engine(num_pages=193), max_tokens) == [
        1,
        2,
        4,
        8,
        12,
        16,
        24,
        32,
        48,
        64,
    ]
    assert measurable_sizes(_engine(num_pages=4096, max_num_seqs=24), max_tokens)[-1] == 24
    assert measurable_sizes(_engine(num_pages=3), max_tokens) == []
