"""Where the background kernel warm-up is off (under TP, on the CPU, `MLASERVE_BACKGROUND_WARM_UP=0`),
the sampler's kernels (greedy's argmax, the sampled draw, the noise) are still compiled at start-up,
in line: a TP2 soak compiled the draw nine times while serving before."""

from __future__ import annotations

from pathlib import Path

import mlaserve
from mlaserve import LLM
from mlaserve.engine import model_runner

DEFAULT_MODEL = Path(mlaserve.__file__).parent / "assets" / "default-model"


def test_sampling_warm_up_runs_in_line_without_the_background_warm_up(monkeypatch) -> None:
    ran: list[tuple[int, str]] = []

    def tasks(vocab_size, device):
        return [lambda: ran.append((vocab_size, device.type))]

    # The CPU has no fused draw: stand in the dispatch test and the tasks (recorded, not run).
    monkeypatch.setattr(model_runner, "fused_noise_available", lambda device: True)
    monkeypatch.setattr(model_runner, "gumbel_argmax_warm_up_tasks", tasks)
    llm = LLM(str(DEFAULT_MODEL), device="cpu", dtype="float32", max_model_len=64)
    assert llm.engine.runner.kernel_warm_up is None  # no background warm-up here
    assert ran == [(llm.engine.model_config.vocab_size, "cpu")]
