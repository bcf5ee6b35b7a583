"""The prefill's per-head keys (`ops/mha_key.py`) against torch's concatenation: bit-equal (a
copy), from the layouts `mha_extend.up_project` passes (kv a view of one GEMM's per-head rows,
k_pe a column slice of the gathered latent)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case, model_dtype

CASES = [gpu_case(s) for s in (1, 31, 2048, 8193)] + [cpu_case(5), cpu_case(33)]


@pytest.mark.parametrize("num_tokens,device", CASES)
def test_mha_key_equals_the_concatenation(num_tokens, device):
    from mlaserve.ops.mha_key import mha_key

    heads, d_n, d_v, rank, d_r = (16, 128, 128, 512, 64) if device == "cuda" else (3, 16, 8, 32, 8)
    g = torch.Generator(device=device).manual_seed(num_tokens)
    dt = model_dtype(device)
    kv = torch.randn(num_tokens, heads * (d_n + d_v), generator=g, device=device).to(dt)
    kv = kv.view(num_tokens, heads, d_n + d_v)
    latent = torch.randn(num_tokens, rank + d_r, generator=g, device=device).to(dt)
    k_pe = latent[:, rank:]
    got = mha_key(kv, k_pe, d_n)
    want = torch.cat([kv[..., :d_n], k_pe[:, None].expand(-1, heads, -1)], dim=-1)
    assert got.is_contiguous() and got.shape == want.shape
    assert torch.equal(got, want)


def test_mha_key_refuses_what_does_not_fit():
    from mlaserve.ops.mha_key import mha_key

    kv = torch.zeros(4, 2, 24, dtype=torch.float16)
    with pytest.raises(ValueError, match="do not fit"):
        mha_key(kv, torch.zeros(5, 8, dtype=torch.float16), 16)
    with pytest.raises(ValueError, match="dtype"):
        mha_key(kv, torch.zeros(4, 8), 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_compile_serves_every_context_length():
    """The context length is not specialised: after one call, prompts of any length compile
    nothing (the GPU server test counts compiles while serving; 2049 tokens once did)."""
    from mlaserve.graph_runner.compile_watch import CompileWatch
    from mlaserve.ops.mha_key import mha_key

    heads, d_n, d_v, rank, d_r = 5, 48, 32, 80, 16  # a shape no other test has

    def call(s: int) -> None:
        kv = torch.zeros(s, heads * (d_n + d_v), device="cuda", dtype=torch.bfloat16)
        latent = torch.zeros(s, rank + d_r, device="cuda", dtype=torch.bfloat16)
        mha_key(kv.view(s, heads, d_n + d_v), latent[:, rank:], d_n)

    call(37)
    watch = CompileWatch()
    watch.mark_ready()
    for s in (1, 16, 2049, 4000):
        call(s)
    assert watch.compiles_since_ready == 0
