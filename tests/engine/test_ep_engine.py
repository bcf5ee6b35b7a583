"""`--enable-expert-parallel` through the engine on the CPU: `LLM(..., tensor_parallel_size=2,
enable_expert_parallel=True)` (rank 1 a worker process, gloo) gives TP1's greedy tokens on the
default model (8 routed experts, 4 a rank), and each rank's model holds whole experts; rank 0
logs every rank's checkpoint bytes and GB/s.

Check: greedy token ids of 3 prompts x 16 tokens equal TP1's (float32: EP only reorders the sum
of each token's experts over the ranks, measured max_rel < 1e-6 on the logits in
tests/model/test_expert_parallel.py); the flag reaches rank 0's model (4 experts of 8, full
intermediate); the CLI takes vLLM's `--enable-expert-parallel`.
"""

from __future__ import annotations

import gc
import logging
import re

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.service.cli import build_parser

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _ids(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _experts(llm: LLM):  # rank 0's last MoE layer's routed experts
    return llm.engine.runner.model.model.layers[-1].mlp.experts


def test_ep2_greedy_equals_tp1(caplog: pytest.LogCaptureFixture) -> None:
    tp1 = LLM(device="cpu")
    want = _ids(tp1)
    whole = _experts(tp1)
    shape = (whole.num_experts, whole.gate_up_proj.shape[1])
    del tp1, whole
    gc.collect()
    with caplog.at_level(logging.INFO, logger="mlaserve"):  # the engine's and the loader's
        ep2 = LLM(device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        # rank 0 logs both ranks' checkpoint reads (each reads its half of the experts)
        assert re.search(r"weights per rank: rank 0 .* GB/s\), rank 1 .* GB/s\)", caplog.text)
        experts = _experts(ep2)
        assert (experts.num_experts, experts.gate_up_proj.shape[1]) == (shape[0] // 2, shape[1])
        assert experts.expert_parallel and experts.first_expert == 0
        assert _ids(ep2) == want
    finally:
        ep2.shutdown()


def test_cli_takes_vllms_flag() -> None:
    args = build_parser().parse_args(["serve", "-tp", "2", "--enable-expert-parallel"])
    assert args.enable_expert_parallel is True and args.tensor_parallel_size == "2"
