"""The grouped MoE kernels vs the fp32 reference of routed + shared experts, bf16 and FP8 weights.

Tolerances and NaN-poisoned unselected experts as in test_moe_decode.py (the same roundings).
Routing is random (a few rows per expert) or concentrated (every token picks the same experts,
so an expert's rows span several BLOCK_M blocks); token counts include ones whose pairs are not
a multiple of 16 and ones past a power of two. The kernels must also agree with `moe_decode` to
the last bit where neither rounds differently: they are the same math on other tiles.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mlaserve.ops.moe_grouped import _f16_rows
from tests.ops.cases import cpu_case, gpu_case, model_dtype
from tests.ops.moe_cases import (
    SHAPES,
    assert_close_to_reference,
    layer_weights,
    make_weights,
    poison_unused,
    reference,
)

CASES = (
    [
        gpu_case(t, shape, fp8, routing)
        for t in (9, 33, 64, 130, 256)
        for shape in ("v2lite", "v3_slice", "default")
        for fp8 in (False, True)
        for routing in ("random", "concentrated")
    ]
    + [  # bf16 takes them up to 512 tokens (`moe.GROUPED_MAX_TOKENS`)
        gpu_case(t, shape, False, routing)
        for t in (300, 512)
        for shape in ("v2lite", "default")
        for routing in ("random", "concentrated")
    ]
    + [
        cpu_case(5, "tiny", False, "random"),
        cpu_case(20, "default", False, "concentrated"),
        cpu_case(7, "tiny_noshared", True, "random"),
        cpu_case(9, "default", True, "concentrated"),
    ]
)


def _routing(routing, num_tokens, num_e, top_k, gen, device):
    if routing == "concentrated":  # the same top_k experts for every token
        chosen = torch.randperm(num_e, generator=gen, device=device)[:top_k]
        return chosen.expand(num_tokens, top_k).contiguous()
    return torch.stack(
        [torch.randperm(num_e, generator=gen, device=device)[:top_k] for _ in range(num_tokens)]
    )


def _layer_case(num_tokens, shape_name, fp8, routing, device, seed):
    """(x, routing weights, ids, the kernels' weights, the fp32 reference's output) of a random
    layer whose unselected experts are NaN-poisoned."""
    shape = SHAPES[shape_name]
    num_e, top_k, num_s, hidden, _ = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    kernel, ref, scales = make_weights(shape, fp8, model_dtype(device), device, gen)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(model_dtype(device))
    ids = _routing(routing, num_tokens, num_e, top_k, gen, device)
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.1
    poison_unused(kernel, scales, ids, num_e, fp8)
    return x, weights, ids, layer_weights(kernel, scales), reference(x, weights, ids, ref, num_s)


@pytest.mark.parametrize("num_tokens,shape_name,fp8,routing,device", CASES)
def test_moe_grouped_matches_reference(num_tokens, shape_name, fp8, routing, device):
    from mlaserve.ops.moe_grouped import moe_grouped

    seed = num_tokens * 5 + SHAPES[shape_name][0]
    x, weights, ids, layer, want = _layer_case(num_tokens, shape_name, fp8, routing, device, seed)
    got = moe_grouped(x, weights, ids, layer, block_m=16 if device == "cpu" else None)
    assert got.dtype == model_dtype(device) and got.shape == x.shape
    assert_close_to_reference(got, want)
    again = moe_grouped(x, weights, ids, layer, block_m=16 if device == "cpu" else None)
    assert torch.equal(got, again), "the order of rows within an expert changed the result"


def test_moe_grouped_refuses_fp32_and_mismatched_input():
    from mlaserve.ops.moe_decode import MoeDecodeWeights
    from mlaserve.ops.moe_grouped import moe_grouped

    layer = MoeDecodeWeights(torch.zeros(4, 64, 64), torch.zeros(4, 64, 32))
    ids = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        moe_grouped(torch.zeros(2, 64), torch.ones(2, 2), ids, layer)
    with pytest.raises(ValueError, match="tokens"):
        moe_grouped(torch.zeros(3, 64, dtype=torch.float16), torch.ones(2, 2), ids, layer)
    many = 4096 // 2 + 1  # one pair past MAX_PAIRS at 2 slots a token: refused before a launch
    ids = torch.zeros(many, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="MAX_PAIRS"):
        moe_grouped(torch.zeros(many, 64, dtype=torch.float16), torch.ones(many, 2), ids, layer)


def test_block_m_grows_with_rows_per_expert():
    from mlaserve.ops.moe_grouped import moe_grouped_block_m

    assert moe_grouped_block_m(64 * 8, 66) == 16  # V2-Lite bs 64: ~8 rows per expert
    assert moe_grouped_block_m(256 * 8, 66) == 32
    assert moe_grouped_block_m(256 * 8, 9) == 64


@triton.jit
def _f16_rows_kernel(a_ptr, q_ptr, s_ptr, K: tl.constexpr, M: tl.constexpr):
    offs = tl.arange(0, M)[:, None] * K + tl.arange(0, K)[None, :]
    q, s = _f16_rows(tl.load(a_ptr + offs))
    tl.store(q_ptr + offs, q)
    tl.store(s_ptr + tl.arange(0, M), s)


@pytest.mark.parametrize("device", [cpu_case(), gpu_case()])
def test_f16_rows_hold_every_bf16_row_exactly(device):
    """The FP8 path meets its activations in f16: each row times a power of two must be exact
    (f16 * scale == a bit for bit), whatever the row's magnitude, zero rows included."""
    gen = torch.Generator(device=device).manual_seed(3)
    m, k = 16, 128
    # rows spanning 2^-100 .. 2^100, each with values 2^20 apart inside it
    mags = 2.0 ** torch.linspace(-100, 100, m, device=device)[:, None]
    spread = 2.0 ** (torch.rand(m, k, generator=gen, device=device) * -20)
    sign = torch.where(torch.rand(m, k, generator=gen, device=device) < 0.5, -1.0, 1.0)
    dtype = model_dtype(device)
    if dtype == torch.float16:  # fp16's range under the interpreter
        mags = 2.0 ** torch.linspace(-4, 14, m, device=device)[:, None]
        spread = 2.0 ** (torch.rand(m, k, generator=gen, device=device) * -8)
    a = (mags * spread * sign).to(dtype)
    a[5] = 0
    q = torch.empty(m, k, dtype=torch.float16, device=device)
    s = torch.empty(m, dtype=torch.float32, device=device)
    _f16_rows_kernel[(1,)](a, q, s, K=k, M=m)
    assert torch.equal(q.float() * s[:, None], a.float())
    assert q.float().abs().amax(dim=1)[[i for i in range(m) if i != 5]].min() >= 2**14


def test_warm_up_tasks_cover_every_variant_once_grouped_by_the_gemms(monkeypatch) -> None:
    """`moe_grouped_warm_up_tasks`: every variant key the token counts make (the pairs' bucket,
    pairs % 16, the GEMMs' block rows and block_k / stages choice) is run by exactly one batch;
    one task holds the batches that share the GEMMs' variant (on threads, two batches reaching
    one GEMM variant at once would both compile it). The batches are recorded, not run (CPU)."""
    from types import SimpleNamespace

    from mlaserve.ops import moe_grouped as module

    ran: list[int] = []
    monkeypatch.setattr(module, "moe_grouped", lambda x, *_: ran.append(x.shape[0]))
    weights = SimpleNamespace(w13=torch.zeros(64, 1, 1), num_shared=2, hidden=8)
    top_k, lo, hi = 6, 17, 512
    tasks = module.moe_grouped_warm_up_tasks(weights, top_k, lo, hi, torch.bfloat16)

    def key(t: int) -> tuple:
        pairs = t * (top_k + 2)
        return (module._num_pairs_bucket(pairs), pairs % 16 == 0, *gemms(t))

    def gemms(t: int) -> tuple:
        return (module.moe_grouped_block_m(t * (top_k + 2), 66), t <= 128)

    per_task = []
    for task in tasks:
        before = len(ran)
        task()
        per_task.append(ran[before:])
    assert sorted(ran) == ran == sorted(set(ran))  # each count once, in order within a task
    assert {key(t) for t in ran} == {key(t) for t in range(lo, hi + 1)}
    assert len({key(t) for t in ran}) == len(ran)  # one batch per variant
    assert [len({gemms(t) for t in batch}) for batch in per_task] == [1] * len(tasks)
    assert len({gemms(batch[0]) for batch in per_task}) == len(tasks) > 1


SPLIT_CASES = [
    cpu_case(7, "default", False, 2),
    cpu_case(9, "default", True, 2),
    gpu_case(8, "v3_slice", True, 4),
    gpu_case(8, "v3_slice", True, 7),
    gpu_case(33, "v3_slice", True, 2),
    gpu_case(8, "v2lite", False, 2),
]


@pytest.mark.parametrize("num_tokens,shape_name,fp8,split,device", SPLIT_CASES)
def test_a_k_split_gate_up_matches_the_reference_and_the_unsplit_kernel(
    num_tokens, shape_name, fp8, split, device
):
    """The gate / up GEMM split over K (each tile's last split to arrive sums the partials in
    split order): within the reference's tolerance, within fp32 summation order of the unsplit
    kernel, bitwise the same on a second call, and the arrival counters back at zero."""
    from mlaserve.ops import moe_grouped as mg

    seed = num_tokens * 7 + split
    x, weights, ids, layer, want = _layer_case(num_tokens, shape_name, fp8, "random", device, seed)
    bm = 16 if device == "cpu" else None
    got = mg.moe_grouped(x, weights, ids, layer, block_m=bm, split=split)
    assert_close_to_reference(got, want)
    assert torch.equal(got, mg.moe_grouped(x, weights, ids, layer, block_m=bm, split=split))
    unsplit = mg.moe_grouped(x, weights, ids, layer, block_m=bm, split=1)
    torch.testing.assert_close(got.float(), unsplit.float(), rtol=2e-2, atol=2e-2)
    from mlaserve.ops.split_counters import split_counters

    assert not split_counters(x.device, 1).any(), "a tile's counter was left set"


def test_gate_up_split_fills_the_sms_with_whole_scale_blocks() -> None:
    from mlaserve.ops.moe_grouped import MAX_SPLIT, gate_up_split

    assert gate_up_split(10_000, 7168, 132) == 1  # enough tiles already
    assert gate_up_split(240, 7168, 132) == 2  # V3 at TP8, 8 tokens: 4 programs an SM wanted
    assert gate_up_split(60, 7168, 132) == 7  # MIN_SPLIT_K: 7168 keys in at most 7 splits
    assert gate_up_split(60, 8192, 132) == MAX_SPLIT
    assert gate_up_split(130, 7168, 132) == 4  # 5 does not divide H's 56 blocks
    assert gate_up_split(10, 2048, 132) == 2  # at least MIN_SPLIT_K keys a split
    assert gate_up_split(10, 256, 132) == gate_up_split(10, 7000, 132) == 1
    # under 2.5 programs an SM only: TP4's 4 tokens split, its 5 (360 tiles) and TP8's 12 not
    assert gate_up_split(288, 7168, 132) == 2
    assert gate_up_split(330, 7168, 132) == gate_up_split(360, 7168, 132) == 1
    assert gate_up_split(432, 7168, 132) == 1
    for tiles in range(1, 600):
        split = gate_up_split(tiles, 7168, 132)
        assert 1 <= split <= MAX_SPLIT and (7168 // 128) % split == 0


def test_a_split_that_cuts_a_scale_block_is_refused() -> None:
    from mlaserve.ops.moe_grouped import moe_grouped

    shape = SHAPES["default"]
    kernel, _, scales = make_weights(
        shape, True, torch.float32, "cpu", torch.Generator().manual_seed(0)
    )
    layer = layer_weights(kernel, scales)
    x = torch.zeros(2, shape[3], dtype=torch.bfloat16)
    ids = torch.zeros(2, shape[1], dtype=torch.int64)
    with pytest.raises(ValueError, match="split 3 does not divide H 256"):
        moe_grouped(x, torch.ones(2, shape[1]), ids, layer, split=3)
