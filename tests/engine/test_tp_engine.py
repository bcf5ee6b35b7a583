"""The engine under tensor parallelism on the CPU: `LLM(..., tensor_parallel_size=2)` starts one
worker process (rank 1, gloo) and matches TP1.

Check: greedy token ids of 3 prompts x 16 tokens equal to TP1's (float32: TP only reorders sums,
measured max_rel < 1e-6 on the logits in tests/model/test_tensor_parallel.py, so the argmaxes
agree exactly); a seeded sampled request equals TP1's with that seed (sampling runs once, on rank
0, over the all-gathered logits); shutdown leaves no child process; a worker killed mid-
generation makes `step` raise EngineDeadError within a bounded time and leaves no child; N = 3
with the default model's 16 heads is a ConfigError naming both numbers.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.config import ConfigError, EngineConfig, ModelConfig
from mlaserve.engine.step_broadcast import INLINE_LEN
from mlaserve.engine.tp_workers import EngineDeadError

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
DEAD_WITHIN_S = 30.0  # a killed worker closes its sockets: the next collective fails at once


def _ids(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _no_children(timeout_s: float = 15.0) -> list:
    deadline = time.monotonic() + timeout_s
    while (left := mp.active_children()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def small_model(checkpoint: Callable[[str], Path]) -> dict:
    return dict(model=str(checkpoint("v3_moe")), page_size=4, max_model_len=128, max_num_seqs=8)


@pytest.mark.parametrize("case", ["default_model", "v3_moe"])
def test_tp2_matches_tp1_then_stops_its_worker(case: str, small_model: dict) -> None:
    kwargs = {} if case == "default_model" else small_model
    tp1 = LLM(device="cpu", **kwargs)
    want = _ids(tp1, GREEDY), _ids(tp1, SEEDED)
    del tp1
    tp2 = LLM(device="cpu", tensor_parallel_size=2, **kwargs)
    try:
        assert len(mp.active_children()) == 1  # rank 1; rank 0 is this process
        assert _ids(tp2, GREEDY) == want[0]
        assert _ids(tp2, SEEDED) == want[1]
    finally:
        tp2.shutdown()
    assert _no_children() == []
    with pytest.raises(EngineDeadError, match="shut down"):
        tp2.engine.step()


def test_tp2_step_past_one_frame_matches_tp1() -> None:
    """A 700-token prompt's EXTEND step (a body of ~2100 values) overflows the step message's
    frame (`step_broadcast.INLINE_LEN`): the worker takes the rest in a second broadcast and
    follows; the decode steps after it fit the frame."""
    prompt = {"prompt_token_ids": [3 + (i * 37) % 4000 for i in range(700)]}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tp1 = LLM(device="cpu", enable_prefix_caching=False)
    want = [list(o.outputs[0].token_ids) for o in tp1.generate([prompt], params, use_tqdm=False)]
    del tp1
    tp2 = LLM(device="cpu", tensor_parallel_size=2, enable_prefix_caching=False)
    try:
        sender, bodies = tp2.engine.runner.step_sender, []
        send = sender._send
        sender._send = lambda header, body: (bodies.append(body.numel()), send(header, body))
        got = tp2.generate([prompt], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in got] == want
        assert max(bodies) > INLINE_LEN > min(bodies)
    finally:
        tp2.shutdown()
    assert _no_children() == []


def _reaches(start: object, target: object, depth: int) -> bool:
    """Whether `target` is among what `start` refers to, within `depth` steps (gc's referents)."""
    seen, level = set(), [start]
    for _ in range(depth):
        level = [r for o in level for r in gc.get_referents(o) if id(r) not in seen]
        if any(r is target for r in level):
            return True
        seen.update(id(r) for r in level)
    return False


def test_collecting_the_llm_stops_its_worker() -> None:
    llm = LLM(device="cpu", tensor_parallel_size=2)
    assert len(mp.active_children()) == 1
    # The workers' state holds the process groups. A watch thread that held it would free them
    # when it ends, off the main thread: inside interpreter shutdown that aborted the process
    # ("terminate called without an active exception"). So no watch thread may reach it.
    state = llm.engine.tp_workers._state
    watchers = [t for t in threading.enumerate() if t.name.startswith("mlaserve-tp-")]
    assert watchers
    for t in watchers:
        assert not _reaches((t._target, t._args, t._kwargs), state, depth=6), t.name
    state = weakref.ref(state)
    del llm
    gc.collect()
    assert state() is None
    assert _no_children() == []


def test_killed_worker_makes_the_engine_dead_and_leaves_no_child() -> None:
    llm = LLM(device="cpu", tensor_parallel_size=2)
    engine = llm.engine
    (pid,) = engine.tp_workers.pids
    engine.add_request("r", "def f(x):", SamplingParams(max_tokens=64, temperature=0.0))
    for _ in range(3):  # prefill + decodes run on both ranks
        engine.step()
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="engine dead") as err:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < DEAD_WITHIN_S
    assert "rank 1: exited with code -9" in str(err.value)
    assert _no_children() == []
    with pytest.raises(EngineDeadError):  # dead for good
        engine.step()
    llm.shutdown()  # harmless after death


def test_heads_not_divisible_is_a_clear_error() -> None:
    config = EngineConfig(device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="3 does not divide the model's 16 attention heads"):
        config.resolved_tensor_parallel_size(ModelConfig.from_pretrained(config.model_path))
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(device="cpu", tensor_parallel_size=3)
    assert mp.active_children() == []  # refused before any worker started


def test_tp_config_checks() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be an integer >= 1"):
        EngineConfig(device="cpu", tensor_parallel_size=0)
    # Graphs, overlap and speculation are taken under TP as on one rank (tests/engine/
    # test_tp_steps.py runs them); on the CPU graphs stay off, as for TP1.
    config = EngineConfig(
        device="cpu", tensor_parallel_size=2, num_speculative_tokens=2, overlap_schedule=True
    )
    assert config.speculative.k == 2 and config.resolved_overlap_schedule()
    assert not config.resolved_cuda_graph()
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device"):
        EngineConfig(device="cpu", tensor_parallel_size=2, cuda_graph=True).resolved_cuda_graph()
