"""What the workers follow under tensor parallelism, on the CPU (2 processes, gloo, float32, the
default model, which has an MTP layer): speculation, overlap scheduling and the graph runner's
routes, each against TP1 greedy.

Why exact equality: in float32 TP only reorders sums (measured max_rel < 1e-6 on the logits,
tests/model/test_tensor_parallel.py), so greedy argmaxes agree, and speculation is lossless.

Cases:
  * MTP speculation (k = 2, forced to speculate every step on both sides, so no timing enters):
    TP2's tokens equal TP1's without speculation, and TP2's accept lengths equal TP1's with it
    (the sharded MTP drafts what TP1's drafts: the draft-extend and draft follow rank 0's
    emitted tokens, broadcast on the device).
  * The graph runner's routes on the CPU: rank 0's runner replaced by one with batch sizes
    (1, 2, 4), shapes DECODE (and VERIFY) and prefill buckets 16 and 32, replayed eagerly
    (`use_graphs=False`: the padded batches and piecewise pieces run as a graph would, attention
    between pieces); the worker builds its twin from the GRAPHS message, both warm up (the
    capture plan checked), and every step follows rank 0's route. With overlap scheduling
    (two steps in flight: the workers read rank 0's fed ids as their future ids), with and
    without speculation.
  * A worker refuses a capture plan not its own, and a graphed route naming a graph it lacks.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.forward_route import ForwardRoute, RoutePath
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.step_broadcast import CaptureMsg, GraphsMsg
from mlaserve.engine.tp_worker import Follower
from mlaserve.graph_runner import CudaGraphRunner
from mlaserve.spec.spec_policy import FORCED_SPEC

# 3 requests: decode and verify batches pad to the captured size 4
PROMPTS = ["def fibonacci(n):", "class Stack:", "x = [i * i for i in range(10)]"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
K = 2
SIZES = (1, 2, 4)
BUCKETS_UP_TO = 32  # the prompts' one prefill (29 tokens) takes bucket 32
# A padded batch attends up to the context capacity (a graph's fixed bound): kept small, so the
# CPU's reference attention does not scan 8192 positions a row.
ENGINE = {"device": "cpu", "max_model_len": 256}


def _ids(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _force_speculation(llm: LLM) -> None:
    llm.engine.spec_decoder.policy.forced = FORCED_SPEC


def _eager_routes(llm: LLM) -> CudaGraphRunner:
    """Rank 0's graph runner replaced by one with padded sizes and prefill buckets, run eagerly
    (its construction tells the workers; its warm-up runs on every rank)."""
    engine = llm.engine
    shapes = [(ForwardMode.DECODE, 1)]
    if engine.spec_decoder is not None:
        shapes.append((ForwardMode.VERIFY, K + 1))
    graphs = CudaGraphRunner(
        engine.runner, SIZES, use_graphs=False, shapes=shapes, piecewise_max_tokens=BUCKETS_UP_TO
    )
    engine.graphs = graphs
    if engine.spec_decoder is not None:
        engine.spec_decoder.graphs = graphs
    graphs.capture()
    return graphs


@pytest.fixture(scope="module")
def tp1() -> dict:
    plain = _ids(LLM(**ENGINE))
    spec = LLM(**ENGINE, num_speculative_tokens=K)
    _force_speculation(spec)
    assert _ids(spec) == plain  # (lossless on one rank: the reference for both below)
    return {"ids": plain, "accept_lengths": spec.engine.get_stats().spec_accept_lengths}


def test_tp2_speculation_is_lossless_and_drafts_as_tp1(tp1: dict) -> None:
    llm = LLM(**ENGINE, tensor_parallel_size=2, num_speculative_tokens=K)
    try:
        _force_speculation(llm)
        assert _ids(llm) == tp1["ids"]
        lengths = llm.engine.get_stats().spec_accept_lengths
        assert lengths == tp1["accept_lengths"]
        assert any(n > 1 for n in lengths)  # drafts were accepted, not only verified
    finally:
        llm.shutdown()
    assert mp.active_children() == []


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "mtp"])
def test_tp2_follows_rank_0s_routes_with_overlap(tp1: dict, spec: bool) -> None:
    kwargs = {"num_speculative_tokens": K} if spec else {}
    llm = LLM(**ENGINE, tensor_parallel_size=2, overlap_schedule=True, **kwargs)
    try:
        graphs = _eager_routes(llm)
        if spec:
            _force_speculation(llm)
        assert _ids(llm) == tp1["ids"]
        engine = llm.engine
        assert graphs.piecewise.num_replays >= 1  # the prefill took a bucket
        assert graphs.num_eager_steps["no_graphs"] >= 1  # decode / verify steps padded
        if not spec:  # plain steps overlap: the workers read the fed ids as future ids
            assert engine.ledger.max_in_flight == 2
        else:
            assert engine.get_stats().spec_accept_lengths == tp1["accept_lengths"]
    finally:
        llm.shutdown()
    assert mp.active_children() == []


def test_a_worker_refuses_a_capture_plan_not_its_own(small_engine) -> None:
    follower = Follower(small_engine.runner, None)
    decode = ((ForwardMode.DECODE, 1),)
    follower.follow(GraphsMsg((1, 2), decode, False, 0))
    with pytest.raises(RuntimeError, match="every rank must capture the same graphs"):
        follower.follow(CaptureMsg((1, 2, 4), decode, ()))


def test_a_graphed_route_without_its_graph_is_refused(small_engine) -> None:
    graphs = CudaGraphRunner(small_engine.runner, (1, 2), use_graphs=False)
    host = HostBatch(ForwardMode.DECODE, [5], [3], [13], [4], [1], [[3]], [])
    with pytest.raises(RuntimeError, match="ranks captured different graphs"):
        graphs.execute(host, ForwardRoute(RoutePath.UNIFORM, 2, graphed=True))
    with pytest.raises(RuntimeError, match="no such prefill bucket"):
        graphs.execute(host, ForwardRoute(RoutePath.PIECEWISE, 16))
