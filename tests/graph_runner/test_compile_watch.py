"""`CompileWatch` tells Triton's compiles (on-disk cache misses) from its cache loads through
Triton's own compilation listener, chained to one already installed; it restores nothing, so
each test puts Triton's knobs back. The listener is called here the way `triton.compile` calls
it (keyword arguments, `cache_hit`): on the CPU Triton cannot compile for real."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from mlaserve.graph_runner import CompileWatch

triton = pytest.importorskip("triton")
knobs = triton.knobs
if not hasattr(getattr(knobs, "compilation", None), "listener"):
    pytest.skip("this Triton has no compilation listener", allow_module_level=True)


@pytest.fixture
def restored_knobs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Triton's hooks put back after the test; a listener already installed records its calls."""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: seen.append(kw))
    return seen


def _build(cache_hit: bool) -> None:
    knobs.compilation.listener(
        src=None, metadata={}, metadata_group={}, times=None, cache_hit=cache_hit
    )


def test_compiles_and_cache_loads_are_counted_apart(
    restored_knobs: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    watch = CompileWatch()
    _build(cache_hit=False)
    _build(cache_hit=True)
    _build(cache_hit=True)
    assert (watch.num_compiled, watch.num_cache_loads) == (1, 2)
    assert watch.compiled == 1
    assert [kw["cache_hit"] for kw in restored_knobs] == [False, True, True]  # chained
    with caplog.at_level(logging.INFO, logger="mlaserve.graph_runner.compile_watch"):
        watch.mark_ready()
    assert any(
        "1 JIT compilations during start-up" in r.getMessage()
        and "2 kernels loaded from the on-disk cache" in r.getMessage()
        for r in caplog.records
    )


def test_a_start_on_a_filled_cache_compiles_nothing(restored_knobs: list[dict[str, Any]]) -> None:
    watch = CompileWatch()
    for _ in range(5):
        _build(cache_hit=True)
    assert watch.compiled == 0 and watch.num_cache_loads == 5
