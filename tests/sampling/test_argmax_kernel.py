"""The greedy argmax kernels vs torch.argmax: the same column on every finite row (ties included),
a non-finite chosen logit exactly on rows that are not finite; on CPU under Triton's
interpreter at small vocabularies, on the GPU at the served ones and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu, gpu_case

CASES = [cpu_case(n, v) for n, v in ((1, 3000), (3, 1024), (2, 1))] + [
    gpu_case(n, v) for n in (1, 8, 64) for v in (102400, 129280)
]


def _logits(n: int, vocab: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(n * 131 + vocab)
    # few distinct values: many ties for the maximum, across column blocks
    x = torch.randint(-50, 50, (n, vocab), generator=g, device=device).float() / 8
    if vocab > 1:
        x[0, vocab // 2] = x.max() + 1
    return x


@pytest.mark.parametrize("n,vocab,device", CASES)
def test_fused_argmax_matches_torch(n, vocab, device):
    from mlaserve.sampling.argmax_kernel import fused_argmax

    x = _logits(n, vocab, device)
    ids, finite = fused_argmax(x)
    assert ids.dtype == torch.int64 and finite.dtype == torch.bool
    assert torch.equal(ids, x.argmax(dim=1))
    assert finite.all()


@pytest.mark.parametrize("device", [cpu_case(), gpu_case()])
def test_fused_argmax_reports_rows_that_are_not_finite(device):
    from mlaserve.sampling.argmax_kernel import fused_argmax

    vocab = 5000
    x = _logits(6, vocab, device)
    x[1, 4000] = float("nan")
    x[2, 10] = float("inf")
    x[3] = float("-inf")
    x[4, 3000] = float("inf")
    x[4, 4500] = float("nan")
    ids, finite = fused_argmax(x)
    assert finite.tolist() == [True, False, False, False, False, True]
    picked = x.gather(1, ids.unsqueeze(1)).squeeze(1)
    assert torch.equal(torch.isfinite(picked), finite)  # the sampler's finite_rows answer
    assert ids[1].item() == 4000 and ids[2].item() == 10 and ids[3].item() == 0
    assert torch.equal(ids[[0, 5]], x[[0, 5]].argmax(dim=1))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu, id="cuda")])
def test_fused_argmax_replays_in_a_cuda_graph(device):
    from mlaserve.sampling.argmax_kernel import fused_argmax

    x = torch.zeros(4, 102400, device=device)
    fused_argmax(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, finite = fused_argmax(x)
    for seed in range(3):
        x.copy_(_logits(4, 102400, device) + seed)
        graph.replay()
        assert torch.equal(ids, x.argmax(dim=1)) and bool(finite.all())


def test_fused_argmax_refuses_other_dtypes():
    from mlaserve.sampling.argmax_kernel import fused_argmax

    with pytest.raises(ValueError, match="float32"):
        fused_argmax(torch.zeros(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("n,vocab,device", [gpu_case(n, v) for n in (1, 4, 128) for v in (129280,)])
def test_row_argmax_takes_the_kernel_on_the_gpu(n, vocab, device, monkeypatch):
    """`row_argmax` (the draft chain's and greedy acceptance's argmax): the kernel's columns on
    float32 CUDA rows, which are torch's; torch's own elsewhere (bf16, CPU)."""
    from mlaserve.sampling import argmax_kernel

    calls = []
    real = argmax_kernel.fused_argmax
    monkeypatch.setattr(argmax_kernel, "fused_argmax", lambda x: calls.append(1) or real(x))
    x = _logits(n, vocab, device)
    assert torch.equal(argmax_kernel.row_argmax(x), x.argmax(dim=-1)) and calls == [1]
    assert torch.equal(argmax_kernel.row_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    assert torch.equal(argmax_kernel.row_argmax(x.cpu()), x.cpu().argmax(dim=-1))
    assert calls == [1]
