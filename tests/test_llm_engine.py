"""`LLMEngine.step`'s own device work: on CUDA every torch op outside the forward is a kernel
launch (~5-10 us of host time that a CUDA-graph replay cannot hide at small batch sizes), so a
steady decode step has a fixed op budget, checked here on CPU through the same code path."""

from __future__ import annotations

from mlaserve.llm_engine import LLMEngine
from mlaserve.sampling_params import RequestOutputKind, SamplingParams
from tests.device_ops import DeviceOps, uncounted


def test_a_steady_greedy_decode_step_runs_eight_device_ops(small_engine: LLMEngine) -> None:
    """Outside the forward: the input split (token rows, length rows, table-row gather; no page
    is appended at this step), argmax, the finite check, and the read-back; an all-greedy
    batch uploads no steps (no row draws noise). On CUDA the staging row's host->device copy
    adds one (a CPU small_engine needs none), and a DECODE graph's own argmax replaces the
    argmax, the finite check and the `where` (tests/graph_runner's GPU test counts that
    path). The code before this test came in ran 19 here."""
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    for i in range(3):
        small_engine.add_request(f"r{i}", [1 + i, 2, 3, 4, 5], greedy)
    for _ in range(4):  # prefill, then decodes; the step after is steady
        small_engine.step()
    runner = small_engine.runner
    forward = runner.forward_with_hidden
    runner.forward_with_hidden = uncounted(forward)
    try:
        # 5 prompt tokens + 3 decoded: the next token is position 8, on a fresh page of 4.
        small_engine.step()
        with DeviceOps() as counted:
            outputs = small_engine.step()
    finally:
        del runner.forward_with_hidden
    assert len(outputs) == 3 and all(o.num_new_tokens == 1 for o in outputs)
    assert dict(counted.ops) == {
        "copy_": 3,  # token rows, length rows, the read-back (device -> host)
        "index_select": 1,  # the batch's page-table rows
        "argmax": 1,
        "gather": 1,  # the finite check of greedy rows: the chosen logit ...
        "isfinite": 1,  # ... is finite
        "where": 1,  # ids and finite flags in one read-back
    }
    while small_engine.has_unfinished_requests():
        small_engine.step()
