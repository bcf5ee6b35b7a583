"""The Blackwell backends' real kernels against the reference backend, on an SM100/103 GPU.

NEVER RUN: we have no B200. These are the tests to run on one (`pytest -m gpu -q
tests/kernels_adapter/test_blackwell_gpu.py` with '.[blackwell]' and the trtllm-gen cubins);
they skip at collection without the packages and at run time without an SM100/103 GPU. The
bounds are first guesses from FlashMLA's measured errors on an H100 (bf16 1e-2; fp8 8e-2 with
the oracle fed the same e4m3 query): replace them with measured values on the first B200 run.
Same problems as the CPU contract tests (`test_blackwell_contract.py`): NaN-poisoned unused
pages, shuffled page tables, k_scale 0.5, cached prefixes, ragged chunks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("tokenspeed_mla")
pytest.importorskip("flashinfer")

from mlaserve.kernels_adapter.tokenspeed import TokenspeedBackend
from mlaserve.kernels_adapter.trtllm import TrtllmBackend
from mlaserve.kv_cache import MLAKVPool
from tests.kernels_adapter.blackwell_problem import (
    HEADS,
    MAX_MODEL_LEN,
    PREFIX,
    Q_LENS,
    RANK,
    ROPE,
    Problem,
    deepseek_config,
    e4m3,
    extend_inputs,
    make_problem,
    reference_decode,
    reference_extend,
    rel_err,
)

CUDA = torch.device("cuda")
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
BOUND = {BF16: 1e-2, FP8: 8e-2}


def _blackwell(capabilities: tuple[tuple[int, int], ...]) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() in capabilities


needs_sm100 = pytest.mark.skipif(
    not _blackwell(((10, 0), (10, 3))), reason="needs an SM100/SM103 GPU (B200/B300)"
)
pytestmark = [pytest.mark.gpu, needs_sm100]


def to_cuda(problem: Problem, backend) -> Problem:
    """The same problem with its pool and batch on the GPU, attached to `backend`."""
    batch = problem.batch
    pool = batch.kv_pool
    gpu_pool = MLAKVPool(
        1, pool.num_pages, pool.page_size, RANK, ROPE, pool.dtype, CUDA, pool.k_scales
    )
    gpu_pool.kv_buffers[0].view(torch.uint8).copy_(pool.kv_buffers[0].view(torch.uint8))
    moved = {
        f.name: getattr(batch, f.name).to(CUDA)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    gpu_batch = dataclasses.replace(batch, kv_pool=gpu_pool, attn_backend=backend, **moved)
    return dataclasses.replace(problem, batch=gpu_batch, new_rows=problem.new_rows.to(CUDA))


def backend_for(name: str, kv_dtype: torch.dtype, page_size: int):
    cls = {"tokenspeed": TokenspeedBackend, "trtllm": TrtllmBackend}[name]
    return cls(deepseek_config(), page_size, kv_dtype, CUDA, 8, MAX_MODEL_LEN, max_q_len=4)


DECODE_CASES = [
    ("tokenspeed", FP8, 64, 1),
    ("tokenspeed", FP8, 32, 3),
    ("trtllm", FP8, 64, 1),
    ("trtllm", FP8, 32, 3),
    ("trtllm", BF16, 64, 2),
]


@pytest.mark.parametrize(("name", "kv_dtype", "page_size", "q_len"), DECODE_CASES)
def test_blackwell_decode_matches_reference(name, kv_dtype, page_size, q_len) -> None:
    backend = backend_for(name, kv_dtype, page_size)
    cpu_problem = make_problem(backend, [10, 0, 130, 63], [q_len] * 4, page_size, kv_dtype)
    problem = to_cuda(cpu_problem, backend)
    q = torch.randn(problem.batch.num_tokens, HEADS, RANK + ROPE).bfloat16()
    backend.prepare(problem.batch)
    rows = problem.new_rows  # fp32, as the CPU reference writes them: same fp8 rounding
    qg = q.to(CUDA)
    out = backend.forward(
        0, qg[..., :RANK], qg[..., RANK:], rows[:, :RANK], rows[:, RANK:], problem.batch
    )
    assert out.shape == (problem.batch.num_tokens, HEADS, RANK) and torch.isfinite(out).all()
    q_kernel = e4m3(q).float() if kv_dtype == FP8 else q.float()
    ref = reference_decode(cpu_problem, q_kernel)
    err = rel_err(out.float().cpu(), ref)
    print(f"{name} decode {kv_dtype} page {page_size} q_len {q_len}: {err:.2e}")
    assert err < BOUND[kv_dtype]


@pytest.mark.parametrize(
    ("name", "kv_dtype"), [("tokenspeed", FP8), ("trtllm", FP8), ("trtllm", BF16)]
)
def test_blackwell_prefill_matches_reference(name, kv_dtype) -> None:
    backend = backend_for(name, kv_dtype, 64)
    cpu_problem = make_problem(backend, PREFIX, Q_LENS, 64, kv_dtype)
    before = cpu_problem.batch.kv_pool.kv_buffers[0].view(torch.uint8).clone()
    problem = to_cuda(cpu_problem, backend)
    q, w_uk, w_uv = extend_inputs(cpu_problem)
    backend.prepare(problem.batch)
    rows = problem.new_rows
    out = backend.forward_extend_mha(
        0, q.to(CUDA), rows[:, :RANK], rows[:, RANK:], w_uk.to(CUDA), w_uv.to(CUDA), problem.batch
    )
    ref = reference_extend(cpu_problem, q, w_uk, w_uv, before)
    err = rel_err(out.float().cpu(), ref)
    print(f"{name} prefill {kv_dtype}: {err:.2e}")
    assert err < BOUND[kv_dtype] + 6e-2  # plus the fp8 rounding of Q, K, V (4.5e-2 on CPU)


@pytest.mark.parametrize("name", ["tokenspeed", "trtllm"])
def test_blackwell_decode_replays_in_a_cuda_graph(name) -> None:
    """prepare + forward captured once, replayed after the sequences grew: equals eager."""
    backend = backend_for(name, FP8, 64)
    # No sequence ends on a page boundary, so one more token stays in its last page.
    problem = to_cuda(make_problem(backend, [10, 0, 130, 40], [1] * 4, 64, FP8), backend)
    batch = problem.batch
    q = torch.randn(batch.num_tokens, HEADS, RANK + ROPE, device=CUDA).bfloat16()
    rows = problem.new_rows

    def step():
        backend.prepare(batch)
        return backend.forward(
            0, q[..., :RANK], q[..., RANK:], rows[:, :RANK], rows[:, RANK:], batch
        )

    step()  # warm-up: every JIT compile happens here
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    batch.seq_lens.add_(1)  # one more token each (all stay inside their pages)
    batch.slot_mapping.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
