"""Expert parallelism (`--enable-expert-parallel`) against TP1 and TP2, on the CPU.

EP2: each of 2 ranks holds half the routed experts whole (the router replicated, the shared
experts and attention tensor-parallel, one all-reduce per MoE layer as under TP). The model runs
in a gloo group (`tp_ranks.run_on_ranks`) through `tp_steps` (ragged prefill, decode steps, MTP),
in float32, on:
    default_model   the shipped default model (8 experts, top-2, 1 shared, MTP)
    v3_fp8_experts  a tiny V3 in FP8 128x128 blocks, every TP2 split block-aligned, kept FP8
                    (CPU-emulated block-FP8 GEMMs, expert rows through the sorted path's bins)
Metric: as tests/model/test_tensor_parallel.py (max_rel over all logit rows; greedy argmax equal
on every row; both ranks' logits bitwise equal), with its bounds. Measured 2026-11-27 (CPU, gloo):
EP2 vs TP1 max_rel 3.5e-7 - 6.0e-7 in every phase of both cases; EP2 vs TP2 the same except the
FP8 case's decode, 8.3e-3: TP2's one outlying row against TP1 (test_tensor_parallel.py says why).

Single process: the experts of two EP ranks, summed, equal the whole layer's for every path
(loop, grouped_mm, dense; float and FP8), with weights read through the loaders (per-expert and
fused forms); and what EP cannot place is a clear error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import mlaserve
from mlaserve.config import ConfigError, EngineConfig, ModelConfig, QuantizationConfig
from mlaserve.model import DeepseekForCausalLM
from mlaserve.model.checkpoint_tensor import CheckpointTensor
from mlaserve.model.layers.moe_experts import FusedExperts
from mlaserve.ops.fp8_quant import quantize_weight_block
from mlaserve.tensor_parallel import NO_TP, TensorParallel
from tests.checkpoints import make_checkpoint
from tests.model.tp_ranks import run_on_ranks
from tests.model.tp_steps import (
    FP8_MAX_REL,
    FP8_MEDIAN_ROW_REL,
    FP8_TP2_DIMS,
    FP32_MAX_REL,
    all_model_steps,
)

DEFAULT_MODEL = Path(mlaserve.__file__).parent / "assets" / "default-model"
CASES = ["default_model", "v3_fp8_experts"]


def tp2_and_ep2_steps(tp: TensorParallel, cases: dict) -> dict[str, dict]:
    """Run on each rank: the cases under TP2, then under EP2 (the same group); and the routed
    experts an EP2 rank of each case holds."""
    ep = dataclasses.replace(tp, expert_parallel=True)
    held = {}
    for name, (path, _) in cases.items():
        experts = DeepseekForCausalLM(ModelConfig.from_pretrained(path), tp=ep).model.layers[-1]
        held[name] = (experts.mlp.experts.num_experts, experts.mlp.experts.first_expert)
    return {"tp2": all_model_steps(tp, cases), "ep2": all_model_steps(ep, cases), "held": held}


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from tools.fp8_checkpoint import quantize_checkpoint_fp8_block

    root = tmp_path_factory.mktemp("ep")
    fp8_src = make_checkpoint(root / "fp8src", "v3_moe", **FP8_TP2_DIMS)
    fp8 = quantize_checkpoint_fp8_block(fp8_src, root / "fp8")
    cases = {"default_model": (str(DEFAULT_MODEL), None), "v3_fp8_experts": (str(fp8), True)}
    rank0, rank1 = run_on_ranks(tp2_and_ep2_steps, 2, root / "ranks", cases)
    return {"tp1": all_model_steps(NO_TP, cases), "rank0": rank0, "rank1": rank1}


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("reference", ["tp1", "tp2"])
@pytest.mark.parametrize("case", CASES)
def test_ep2_logits_match(case: str, reference: str, ep_runs: dict) -> None:
    ep0, ep1 = ep_runs["rank0"]["ep2"][case], ep_runs["rank1"]["ep2"][case]
    assert [ep_runs[r]["held"][case] for r in ("rank0", "rank1")] == [(4, 0), (4, 4)]  # of 8
    ref = ep_runs["tp1"][case] if reference == "tp1" else ep_runs["rank0"]["tp2"][case]
    assert sorted(ep0) == sorted(ref) and "decode" in ep0
    fp8 = case.endswith("experts")
    for phase in ref:
        assert torch.equal(ep0[phase], ep1[phase]), f"{phase}: ranks 0 and 1 disagree"
        err = _max_rel(ep0[phase], ref[phase])
        print(f"{case} {phase}: EP2 vs {reference.upper()} max_rel {err:.2e}")
        assert err <= (FP8_MAX_REL if fp8 else FP32_MAX_REL), f"{phase}: max_rel {err:.2e}"
        if fp8:
            rows = (ep0[phase] - ref[phase]).abs().amax(-1) / ref[phase].abs().max()
            assert rows.median() <= FP8_MEDIAN_ROW_REL, f"{phase}: median row {rows.median()}"
        assert torch.equal(ep0[phase].argmax(-1), ref[phase].argmax(-1)), f"{phase}: greedy"


# ----- single process: the routed experts of EP ranks sum to the whole layer's -----

E, H, INTER, T, K = 8, 256, 256, 23, 3


def _experts(
    tp: TensorParallel, quant: QuantizationConfig | None, weights: dict, fused: bool
) -> FusedExperts:
    m = FusedExperts(E, H, INTER, tp=tp, quant=quant)
    if fused:  # transformers' [E, 2I, H] / [E, H, I] (float only)
        gate_up = torch.cat([weights["gate"], weights["up"]], 1)
        m.gate_up_proj.weight_loader(m.gate_up_proj, CheckpointTensor.from_tensor(gate_up))
        m.down_proj.weight_loader(m.down_proj, CheckpointTensor.from_tensor(weights["down"]))
        return m
    for e in range(E):
        for s, name in enumerate(("gate", "up")):
            w = weights[name][e]
            t = (
                CheckpointTensor.from_tensor(*quantize_weight_block(w))
                if quant
                else CheckpointTensor.from_tensor(w)
            )
            m.gate_up_proj.weight_loader(m.gate_up_proj, t, expert_id=e, shard_id=s)
        w = weights["down"][e]
        t = (
            CheckpointTensor.from_tensor(*quantize_weight_block(w))
            if quant
            else CheckpointTensor.from_tensor(w)
        )
        m.down_proj.weight_loader(m.down_proj, t, expert_id=e)
    return m


@pytest.mark.parametrize(
    ("impl", "fp8", "fused"),
    [
        ("loop", False, False),
        ("loop", False, True),
        ("dense", False, False),
        ("grouped_mm", False, False),
        ("loop", True, False),  # FP8: the sorted path with the emulated grouped GEMM
    ],
)
def test_ep_ranks_sum_to_the_whole_layer(impl: str, fp8: bool, fused: bool) -> None:
    g = torch.Generator().manual_seed(0)
    weights = {
        "gate": torch.randn(E, INTER, H, generator=g) / 16,
        "up": torch.randn(E, INTER, H, generator=g) / 16,
        "down": torch.randn(E, H, INTER, generator=g) / 16,
    }
    quant = QuantizationConfig() if fp8 else None
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    topk_w = torch.rand(T, K, generator=g)
    shared = torch.randn(T, H, generator=g)
    whole = _experts(NO_TP, quant, weights, fused)
    whole.impl = impl
    expected = whole(x, topk_w, ids, shared)
    parts = []
    for r in range(2):
        m = _experts(TensorParallel(r, 2, expert_parallel=True), quant, weights, fused)
        assert m.num_experts == E // 2 and m.gate_up_proj.shape == (E // 2, 2 * INTER, H)
        m.impl = impl
        # the shared experts' partial goes in once (rank 0), as the MoE layer's TP shards do
        parts.append(m(x, topk_w, ids, shared if r == 0 else torch.zeros_like(shared)))
        local = m.local_ids(ids)
        assert ((local == E // 2) == ((ids // (E // 2)) != r)).all()
    # fp32 throughout; only the order of the K products' sum differs (split over two ranks)
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-5)


def test_tokens_routed_only_to_other_ranks_get_zero() -> None:
    g = torch.Generator().manual_seed(1)
    m = FusedExperts(E, 64, 32, tp=TensorParallel(0, 2, expert_parallel=True))
    m.gate_up_proj.data.normal_(generator=g)
    m.down_proj.data.normal_(generator=g)
    ids = torch.tensor([[4, 5], [6, 7], [0, 7]])  # rank 0 holds experts 0..3
    y = m(torch.randn(3, 64, generator=g), torch.ones(3, 2), ids)
    assert (y[:2] == 0).all() and (y[2] != 0).any()


def test_fp8_grouped_layout_skips_the_other_rank_bin() -> None:
    """The FP8 grouped GEMM's block map under EP (what `_forward_sorted` hands the CUDA kernel):
    every local row sits in a block of its expert, the other-rank bin's rows only in blocks
    marked -1, which the kernel skips (`fp8_triton.py`)."""
    m = FusedExperts(8, 128, 128, tp=TensorParallel(1, 2, expert_parallel=True))
    all_counts = torch.tensor([3, 0, 17, 1, 6], dtype=torch.int32)  # 4 local experts + other
    layout = m._layout(all_counts, 27)
    rows = layout.sorted_rows.view(-1, layout.block_m)
    assert set(layout.block_expert.tolist()) <= {-1, 0, 2, 3}
    bounds = [0, 3, 3, 20, 21]
    for block, expert in zip(rows, layout.block_expert.tolist(), strict=True):
        real = block[block < 27]
        if expert >= 0:
            assert ((real >= bounds[expert]) & (real < bounds[expert + 1])).all()
        else:
            assert (real >= 21).all()  # only the other ranks' pairs
    computed = rows[layout.block_expert >= 0]
    assert sorted(computed[computed < 27].tolist()) == list(range(21))


def test_experts_not_divisible_by_ranks_raise(checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match=r"n_routed_experts .*: 8 is not divisible by .* 3"):
        FusedExperts(8, 64, 32, tp=TensorParallel(0, 3, expert_parallel=True))
    config = ModelConfig.from_pretrained(checkpoint("v3_moe"))  # 8 experts, 4 heads
    engine = EngineConfig(
        model=str(checkpoint("v3_moe")),
        device="cpu",
        tensor_parallel_size=4,
        enable_expert_parallel=True,
    )
    engine.resolved_tensor_parallel_size(config)  # 8 experts over 4 ranks: 2 each
    bad = dataclasses.replace(config, n_routed_experts=6, n_group=2, topk_group=1)
    with pytest.raises(ConfigError, match=r"enable_expert_parallel: .*6 routed experts"):
        engine.resolved_tensor_parallel_size(bad)


# ----- GPU: the sorted path's other-rank bin on the CUDA kernels, V3-sized experts -----

# bf16 outputs: the whole layer rounds one sum of K products to bf16, the EP ranks two partial
# sums, then their bf16 sum: within a few bf16 ulps of the output's scale.
GPU_REL = 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
def test_ep_ranks_sum_to_the_whole_layer_on_gpu(fp8: bool, num_tokens: int) -> None:
    """V3's expert shape (H 7168, I 2048, top-8) with 32 experts over 2 EP ranks: the sum of the
    ranks' outputs equals the whole layer's (sort kernel, grouped_mm or the FP8 grouped GEMM
    with the other-rank blocks marked -1, the sorted combine)."""
    e, h, inter, k = 32, 7168, 2048, 8
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    quant = QuantizationConfig() if fp8 else None
    with torch.device(dev):
        whole = FusedExperts(e, h, inter, params_dtype=torch.bfloat16, quant=quant)
        kw = {"params_dtype": torch.bfloat16, "quant": quant}
        ranks = [TensorParallel(r, 2, expert_parallel=True) for r in range(2)]
        parts = [FusedExperts(e, h, inter, tp=tp, **kw) for tp in ranks]
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(whole, name)
        w = torch.randn(full.shape, generator=g, device=dev) / 32
        if fp8:
            wq, s = quantize_weight_block(w)
            full.data.copy_(wq)
            getattr(whole, f"{name}_scale_inv").data.copy_(s)
        else:
            full.data.copy_(w)
        for r, part in enumerate(parts):
            half = slice(r * e // 2, (r + 1) * e // 2)
            getattr(part, name).data.copy_(full.data[half])
            if fp8:
                scale = getattr(whole, f"{name}_scale_inv").data[half]
                getattr(part, f"{name}_scale_inv").data.copy_(scale)
    x = torch.randn(num_tokens, h, generator=g, device=dev).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g, device=dev)[:k] for _ in range(num_tokens)])
    topk_w = torch.rand(num_tokens, k, generator=g, device=dev)
    expected = whole(x, topk_w, ids).float()
    got = sum(part(x, topk_w, ids).float() for part in parts)
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"EP2 vs whole, {num_tokens} tokens, {'fp8' if fp8 else 'bf16'}: max_rel {err:.2e}")
    assert err <= GPU_REL
