"""FP8 block checkpoints on a CUDA GPU (SM89+; written for the H100): the weights stay FP8 in
GPU memory, the logits stay within stated bounds of the dequantised bf16 model, and a DECODE
forward neither syncs with the host nor changes when captured in a CUDA graph.

Bounds (first set from the CPU emulation of the same math, test_fp8_loading.py: median
token_rel 0.055-0.146, argmax agreement 0.72-0.85 on these random tiny models, whose logits
swing on every MoE routing flip; bf16 activations add the bf16 test's ~0.015). Record the GPU
numbers printed by `-s` in bench/RESULTS.md; tighten, never loosen.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mlaserve.config import ModelConfig
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.model import load_model
from mlaserve.model.loader import fp8_runs_on
from tests.model.fp8_checkpoints import fp8_pair, prompt_logits, prompts, token_rel
from tests.model.paged import PagedCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MEDIAN_BOUND = 0.25  # median token_rel, FP8 (bf16 activations) vs dequantised bf16 model
ARGMAX_MIN = 0.6  # teacher-forced greedy-token agreement with the dequantised bf16 model
VS_EMULATED_MEDIAN_BOUND = 0.1  # GPU kernels vs the CPU emulation of the same FP8 math
CASES = [("v3_mtp", True), ("v3_moe", False)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("fp8gpu")
    cache: dict[tuple, tuple[Path, Path]] = {}

    def get(variant: str, aligned: bool):
        if (variant, aligned) not in cache:
            cache[variant, aligned] = fp8_pair(root, variant, aligned=aligned)
        return cache[variant, aligned]

    return get


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(("variant", "aligned"), CASES)
def test_weights_stay_fp8_in_gpu_memory(variant: str, aligned: bool, pair) -> None:
    fp8, plain = pair(variant, aligned)
    config = ModelConfig.from_pretrained(fp8)
    assert fp8_runs_on(torch.device("cuda")), "SM89+ with Triton expected on the GPU host"
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = load_model(config, fp8, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before
    ref = load_model(ModelConfig.from_pretrained(plain), plain, dtype=torch.bfloat16, device="cuda")

    fp8_params = {n: p for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert any("experts.gate_up_proj" in n for n in fp8_params)
    assert any("self_attn.o_proj" in n for n in fp8_params)
    ref_params = dict(ref.named_parameters())
    for name, p in fp8_params.items():
        assert p.is_cuda and ref_params[name].dtype == torch.bfloat16
    # Each FP8 weight costs half its bf16 bytes plus fp32 scales (<= 1/32 of it for per-row).
    saved = sum(p.numel() for p in fp8_params.values())  # bytes saved vs bf16: 1 per element
    assert param_bytes(model) <= param_bytes(ref) - saved * (1 - 4 / 128 * 2)
    # No bf16 shadow or copy anywhere: what load_model left allocated is its parameters and
    # buffers (rotary caches), nothing the size of the weights again.
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert allocated <= (param_bytes(model) + buffers) * 1.02 + (1 << 20), (
        allocated,
        param_bytes(model),
    )
    print(f"\n{variant}: params {param_bytes(model)} B (bf16 model {param_bytes(ref)} B)")


@pytest.mark.parametrize(("variant", "aligned"), CASES)
def test_logits_and_greedy_tokens_vs_dequantised_bf16(variant: str, aligned: bool, pair) -> None:
    fp8, plain = pair(variant, aligned)
    config = ModelConfig.from_pretrained(fp8)
    model = load_model(config, fp8, dtype=torch.bfloat16, device="cuda")
    ref_model = load_model(config, plain, dtype=torch.bfloat16, device="cuda")
    kw = {"device": "cuda", "kv_dtype": torch.bfloat16}
    ours, ref = prompt_logits(model, config, **kw), prompt_logits(ref_model, config, **kw)
    emulated = prompt_logits(load_model(config, fp8, keep_fp8=True), config)
    rel, vs_emulated = token_rel(ours, ref), token_rel(ours, emulated)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(
        f"\n{variant}: token_rel median {rel.median():.4f} max {rel.max():.4f}; greedy agreement "
        f"{agree:.3f}; vs CPU emulation median {vs_emulated.median():.4f}"
    )
    assert rel.median() <= MEDIAN_BOUND
    assert agree >= ARGMAX_MIN
    assert vs_emulated.median() <= VS_EMULATED_MEDIAN_BOUND


@pytest.mark.parametrize(("variant", "aligned"), CASES)
def test_fp8_decode_is_graph_safe(variant: str, aligned: bool, pair) -> None:
    """No host sync in a DECODE forward of the FP8 model, and a captured replay equals eager."""
    fp8, _ = pair(variant, aligned)
    config = ModelConfig.from_pretrained(fp8)
    model = load_model(config, fp8, dtype=torch.bfloat16, device="cuda")
    cache = PagedCache(config, kv_dtype=torch.bfloat16, device="cuda")
    seqs = [ids for _, ids in prompts()][1:3]
    model(cache.batch([(0, seqs[0][:-1]), (1, seqs[1][:-1])]))  # prefill: KV of the prompts
    batch = cache.batch([(0, seqs[0][-1:]), (1, seqs[1][-1:])], ForwardMode.DECODE)
    model(batch)  # warm-up: Triton compiles outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = model.compute_logits(model(batch))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = model.compute_logits(model(batch))
    graph.replay()
    torch.testing.assert_close(static, eager, rtol=0, atol=0)
