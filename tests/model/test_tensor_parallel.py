"""The model under tensor parallelism (TP2, eager) against TP1, on the CPU: 2 processes in a
gloo group (`tp_ranks.run_on_ranks`), each loading the same checkpoint with its
`TensorParallel(rank, 2, group)` and running a ragged prefill, decode steps and the MTP layer over
the paged cache and the reference backend (`tp_steps`), in float32.

Cases: the shipped default model (V3: 16 heads, dense + MoE layers, MTP, vocab 4096); the tiny V3
MoE checkpoint; the tiny V2 one without q_lora (q_proj column-parallel apart from kv_a); a tiny
V3 + MTP with an odd vocabulary (509: padded to 510, 255 rows a rank); a tiny V3 in FP8 128x128
blocks with every split block-aligned, kept FP8 (CPU-emulated block-FP8 GEMMs).

Metric per phase: max_rel = max |TP2 - TP1| / max |TP1| over all logit rows; greedy argmax equal
on every row; rank 0's and rank 1's logits bitwise equal (the all-gather hands both the same).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import mlaserve
from mlaserve.config import ModelConfig, QuantizationConfig
from mlaserve.model import DeepseekForCausalLM
from mlaserve.model.checkpoint_tensor import CheckpointTensor as CT
from mlaserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from mlaserve.model.layers.linear import (
    NO_TP,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    all_reduce,
)
from mlaserve.model.layers.mlp import DeepseekMLP
from mlaserve.model.layers.moe import DeepseekMoE
from mlaserve.model.layers.moe_experts import FusedExperts
from mlaserve.ops.fp8_quant import quantize_weight_block
from mlaserve.ops.invariant_rowwise import tree_sum
from mlaserve.tensor_parallel import all_gather, broadcast
from tests.checkpoints import make_checkpoint
from tests.model.tp_ranks import run_on_ranks
from tests.model.tp_steps import (
    FP8_MAX_REL,
    FP8_MEDIAN_ROW_REL,
    FP8_TP2_DIMS,
    FP32_MAX_REL,
    all_model_steps,
    collective_steps,
    failing_steps,
    rank_tensor,
    row_parallel_bf16_steps,
    row_parallel_weights,
)

DEFAULT_MODEL = Path(mlaserve.__file__).parent / "assets" / "default-model"
CASES = ["default_model", "v3_moe", "v2_no_q_lora", "v3_mtp_odd_vocab", "v3_moe_fp8"]


@pytest.fixture(scope="module")
def tp_runs(
    checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict, dict, dict]]:
    """case -> (TP1 logits, TP2 rank 0's, TP2 rank 1's), per phase; one 2-process run for all."""
    from tools.fp8_checkpoint import quantize_checkpoint_fp8_block

    root = tmp_path_factory.mktemp("tp")
    odd = make_checkpoint(root / "odd", "v3_mtp", vocab_size=509)
    fp8_src = make_checkpoint(root / "fp8src", "v3_moe", **FP8_TP2_DIMS)
    fp8 = quantize_checkpoint_fp8_block(fp8_src, root / "fp8")
    cases = {
        "default_model": (str(DEFAULT_MODEL), None),
        "v3_moe": (str(checkpoint("v3_moe")), None),
        "v2_no_q_lora": (str(checkpoint("v2_no_q_lora")), None),
        "v3_mtp_odd_vocab": (str(odd), None),
        "v3_moe_fp8": (str(fp8), True),
    }
    rank0, rank1 = run_on_ranks(all_model_steps, 2, root / "ranks", cases)
    tp1 = all_model_steps(NO_TP, cases)
    return {name: (tp1[name], rank0[name], rank1[name]) for name in cases}


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("case", CASES)
def test_tp2_logits_match_tp1(case: str, tp_runs: dict) -> None:
    tp1, rank0, rank1 = tp_runs[case]
    phases = ["prefill", "decode"] + (
        ["mtp"] if case in ("default_model", "v3_mtp_odd_vocab") else []
    )
    assert sorted(tp1) == sorted(phases) == sorted(rank0)
    bound = FP8_MAX_REL if case.endswith("fp8") else FP32_MAX_REL
    for phase in phases:
        ref, ours = tp1[phase], rank0[phase]
        assert ours.shape == ref.shape and ours.dtype == torch.float32, phase
        assert torch.equal(rank1[phase], ours), f"{phase}: ranks 0 and 1 disagree"
        err = _max_rel(ours, ref)
        print(f"{case} {phase}: TP2 vs TP1 max_rel {err:.2e} over {tuple(ref.shape)}")
        assert err <= bound, f"{phase}: max_rel {err:.2e} > {bound:.0e}"
        if case.endswith("fp8"):
            rows = (ours - ref).abs().amax(-1) / ref.abs().max()
            assert rows.median() <= FP8_MEDIAN_ROW_REL, f"{phase}: median row {rows.median()}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"{phase}: greedy tokens differ"


# ----- collectives -----


def test_collectives_under_gloo_equal_the_local_computation(tmp_path: Path) -> None:
    results = run_on_ranks(collective_steps, 2, tmp_path)
    x0, x1 = rank_tensor(0), rank_tensor(1)
    for got in results:
        torch.testing.assert_close(got["all_reduce"], x0 + x1, rtol=0, atol=0)
        torch.testing.assert_close(got["all_gather_0"], torch.cat([x0, x1], 0), rtol=0, atol=0)
        torch.testing.assert_close(got["all_gather_last"], torch.cat([x0, x1], -1), rtol=0, atol=0)
        row = torch.cat([x0[:1], x1[:1]], -1)
        torch.testing.assert_close(got["all_gather_row"], row, rtol=0, atol=0)
        mid = torch.cat([x0.view(3, 2, 2), x1.view(3, 2, 2)], 1)
        torch.testing.assert_close(got["all_gather_mid"], mid, rtol=0, atol=0)
        torch.testing.assert_close(got["broadcast"], x1, rtol=0, atol=0)
        torch.testing.assert_close(got["broadcast_strided"], x0.t(), rtol=0, atol=0)
        assert torch.equal(got["tree_all_reduce"], tree_sum(torch.stack([x0, x1])))


def test_tree_all_reduce_is_identity_on_one_rank_and_takes_fp32_subtrees_only() -> None:
    x = rank_tensor(0)
    assert NO_TP.tree_all_reduce(x) is x and NO_TP.tree_leaves == 8
    assert TensorParallel(1, 4).tree_leaves == 2
    with pytest.raises(ValueError, match="fp32"):
        TensorParallel(0, 2).tree_all_reduce(x.bfloat16())
    with pytest.raises(ValueError, match="must divide"):
        _ = TensorParallel(0, 3).tree_leaves


def test_row_parallel_bf16_partials_are_summed_in_fp32(tmp_path: Path) -> None:
    """bf16 under TP2: the partial sums reduced in fp32 and rounded once (the default) give the
    one-rank layer's bits except where fp32 summation order crosses a rounding boundary (at
    most one bf16 step there); each rank rounding its partial first (MLASERVE_TP_FP32_REDUCE=0)
    parts from them far more often. Measured (2026-11-29, CPU): 0 of 8192 outputs differ in the
    wide form, 3092 in the narrow."""
    x, w = row_parallel_weights()
    want = (x.float() @ w.float().t()).to(torch.bfloat16)  # one rank: the fp32 sum rounded once
    results = run_on_ranks(row_parallel_bf16_steps, 2, tmp_path)
    for got in results:
        assert got["wide"].dtype == got["narrow"].dtype == torch.bfloat16
        wide = (got["wide"] != want).float().mean().item()
        narrow = (got["narrow"] != want).float().mean().item()
        assert wide <= 0.01, f"wide: {wide:.4f} of outputs differ from the one-rank rounding"
        step = torch.finfo(torch.bfloat16).eps * want.float().abs() * 2
        assert ((got["wide"].float() - want.float()).abs() <= step).all()
        assert narrow >= 10 * max(wide, 0.005), f"narrow {narrow:.4f} vs wide {wide:.4f}"
        assert torch.equal(results[0]["wide"], got["wide"])  # every rank has the same sum


def test_a_failing_rank_fails_the_run_without_a_hang(tmp_path: Path) -> None:
    """Rank 1 raises while rank 0 waits for it in an all-reduce: the parent kills rank 0 at
    once and raises with rank 1's traceback (gloo's own timeout would take a minute)."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 fails on purpose"):
        run_on_ranks(failing_steps, 2, tmp_path)
    assert time.monotonic() - start < 45


def test_one_rank_makes_no_distributed_call(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("NO_TP called torch.distributed")

    for name in ("all_reduce", "all_gather", "broadcast", "is_initialized", "get_global_rank"):
        monkeypatch.setattr(torch.distributed, name, refuse)
    x = torch.randn(3, 4)
    assert all_reduce(x, NO_TP) is x and NO_TP.all_reduce(x) is x
    assert all_gather(x, NO_TP, 0) is x and broadcast(x, NO_TP) is x
    emb, head = VocabParallelEmbedding(8, 4), ParallelLMHead(8, 4)
    emb.weight.data.normal_()
    head.weight.data.normal_()
    assert emb(torch.tensor([1, 7])).shape == (2, 4) and head(x[:, :4]).shape == (3, 8)
    assert TensorParallel() == NO_TP and TensorParallel(0, 2).group is None


def test_collectives_without_a_process_group_say_so() -> None:
    with pytest.raises(RuntimeError, match=r"torch.distributed is not initialised"):
        all_reduce(torch.ones(2), TensorParallel(0, 2))


# ----- what TP cannot split: clear errors at construction -----


def test_indivisible_dimensions_raise_naming_them(checkpoint: Callable[[str], Path]) -> None:
    config = ModelConfig.from_pretrained(checkpoint("v3_moe"))  # 4 heads
    with pytest.raises(ValueError, match=r"num_attention_heads: 4 is not divisible by .* size 3"):
        DeepseekForCausalLM(config, tp=TensorParallel(0, 3))
    with pytest.raises(ValueError, match=r"intermediate_size .*: 33 is not divisible"):
        DeepseekMLP(64, 33, tp=TensorParallel(1, 2))
    with pytest.raises(ValueError, match="moe_intermediate_size: 33 is not divisible"):
        FusedExperts(8, 64, 33, tp=TensorParallel(1, 2))


def test_deterministic_sums_outside_the_tree_raise_naming_them(
    checkpoint: Callable[[str], Path],
) -> None:
    """The deterministic mode sums a row-parallel K and the experts' intermediate dim in 8 equal
    leaves (FP8: of 128 columns): anything else is refused at construction, on one rank too."""
    with pytest.raises(ValueError, match=r"RowParallelLinear\(in=12\).* 8 equal leaves"):
        RowParallelLinear(12, 4, deterministic=True)
    with pytest.raises(ValueError, match=r"RowParallelLinear\(in=512\).*multiples of 128"):
        RowParallelLinear(512, 256, quant=QuantizationConfig(), deterministic=True)
    config = ModelConfig.from_pretrained(checkpoint("v3_moe"))
    odd = dataclasses.replace(config, moe_intermediate_size=36)
    with pytest.raises(ValueError, match=r"moe_intermediate_size 36: .* 8 equal leaves"):
        DeepseekMoE(odd, tp=TensorParallel(0, 2), deterministic=True)
    RowParallelLinear(16, 4, tp=TensorParallel(1, 2), deterministic=True)  # 8 leaves of 2


def test_fp8_split_inside_a_block_raises_naming_the_layer_and_dimension() -> None:
    quant, tp = QuantizationConfig(), TensorParallel(0, 2)
    with pytest.raises(
        ValueError, match=r"ColumnParallelLinear.* out_features: .*384 over 2 ranks is 192"
    ):
        ColumnParallelLinear(128, 384, tp=tp, quant=quant)
    with pytest.raises(ValueError, match=r"RowParallelLinear.* in_features: .*384 over 2 ranks"):
        RowParallelLinear(384, 128, tp=tp, quant=quant)
    with pytest.raises(ValueError, match=r"routed experts .* moe_intermediate_size: .*128 over 2"):
        FusedExperts(2, 128, 128, tp=tp, quant=quant)
    ColumnParallelLinear(128, 512, tp=tp, quant=quant)  # 256 a rank: whole blocks


# ----- loaders: this rank's slice -----


def test_odd_vocabulary_is_padded_per_rank() -> None:
    full = torch.randn(509, 4)
    shards = [VocabParallelEmbedding(509, 4, tp=TensorParallel(r, 2)) for r in range(2)]
    for emb in shards:
        emb.weight.data.fill_(float("nan"))
        emb.weight.weight_loader(emb.weight, CT.from_tensor(full))
    assert [e.weight.shape[0] for e in shards] == [255, 255]
    torch.testing.assert_close(torch.cat([e.weight.data for e in shards])[:509], full)
    assert (shards[1].weight.data[254] == 0).all()  # the padding row


def test_fp8_weights_and_block_scales_are_sliced_alike() -> None:
    quant, g = QuantizationConfig(), torch.Generator().manual_seed(0)
    w, s = quantize_weight_block(torch.randn(512, 256, generator=g))
    for cls, dim in ((ColumnParallelLinear, 0), (RowParallelLinear, 1)):
        shape = (256, 512)  # in, out: the weight is [512, 256]
        whole = cls(*shape, quant=quant)
        whole.weight.weight_loader(whole.weight, CT.from_tensor(w, s))
        for r in range(2):
            part = cls(*shape, tp=TensorParallel(r, 2), quant=quant)
            part.weight.weight_loader(part.weight, CT.from_tensor(w, s))
            n = part.weight.shape[dim]
            bits = whole.weight.data.view(torch.uint8).narrow(dim, r * n, n)
            assert torch.equal(part.weight.data.view(torch.uint8), bits), cls.__name__
            scale = whole.weight_scale_inv.data.narrow(dim, r * n // 128, n // 128)
            assert torch.equal(part.weight_scale_inv.data, scale), cls.__name__

    experts = [FusedExperts(2, 256, 512, tp=TensorParallel(r, 2), quant=quant) for r in range(2)]
    whole = FusedExperts(2, 256, 512, quant=quant)
    gate, gs = quantize_weight_block(torch.randn(512, 256, generator=g))
    down, ds = quantize_weight_block(torch.randn(256, 512, generator=g))
    for m in (whole, *experts):
        for e in range(2):
            for shard in (0, 1):
                m.fp8_weight_loader(m.gate_up_proj, CT.from_tensor(gate, gs), e, shard)
            m.fp8_weight_loader(m.down_proj, CT.from_tensor(down, ds), e)
    for r, part in enumerate(experts):
        rows = whole.gate_up_proj.data.view(torch.uint8)[
            :, [*range(r * 256, r * 256 + 256), *range(512 + r * 256, 768 + r * 256)]
        ]
        assert torch.equal(part.gate_up_proj.data.view(torch.uint8), rows)
        scale_rows = whole.gate_up_proj_scale_inv.data[:, [2 * r, 2 * r + 1, 4 + 2 * r, 5 + 2 * r]]
        assert torch.equal(part.gate_up_proj_scale_inv.data, scale_rows)
        cols = whole.down_proj.data.view(torch.uint8)[..., r * 256 : (r + 1) * 256]
        assert torch.equal(part.down_proj.data.view(torch.uint8), cols)
        assert torch.equal(
            part.down_proj_scale_inv.data, whole.down_proj_scale_inv.data[..., 2 * r : 2 * r + 2]
        )
