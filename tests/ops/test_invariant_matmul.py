"""The batch-invariant matmul (`ops/invariant_matmul.py`): against its fp32 torch form, and
invariant itself, bitwise.

Accuracy: each case against `rowwise_matmul` (fp32 products and sums, rounded once); the
operands are the leading rows and columns of NaN-filled buffers (x's rows end in NaN past K, and
NaN rows follow the last one), so a read past K or past M shows as NaN. Tolerance:
|got - ref| <= eps(out dtype) * |ref| + 1e-3 * max |ref| (the one rounding, plus fp32 sums in
another order); fp32 outputs 1e-5 relative.

Invariance: the same rows computed alone, inside batches of 1, 3, 17 and 64 rows (at different
offsets in the tile), and next to rows of garbage (huge values, NaN): identical bits.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.ops.fp8_quant import expand_scale_rows, quantize_weight_block
from mlaserve.ops.invariant_rowwise import rowwise_head_matmul, rowwise_matmul
from tests.ops.cases import cpu_case, gpu_case, model_dtype, row_invariant_interpreter_dot

# (N, K) at serving sizes: the default model (hidden 256, q_lora 64, latent 576, vocab 4096) and
# V3-lite (hidden 2048, q 3072 + latent 576, experts' shared MLP, vocab 102400)
GPU_SHAPES = {
    "default_q_kv_a": (640, 256),
    "default_q_b": (1280, 64),
    "default_o": (256, 256),
    "default_lm_head": (4096, 256),
    "v3lite_q_kv_a": (3648, 2048),
    "v3lite_o": (2048, 2048),
    "v3lite_shared_gate_up": (5632, 2048),
    "v3lite_lm_head": (102400, 2048),
    "ragged": (1000, 1400),
}
GPU_CASES = [
    gpu_case(shape, weights)
    for shape in GPU_SHAPES
    for weights in ("dtype", "fp8_block", "fp8_row", "fp32_router")
    if not (weights == "fp32_router" and GPU_SHAPES[shape][0] > 4096)
]
# (N, K, weights): tiny, the interpreter runs each program in numpy
CPU_CASES = [
    cpu_case((24, 96), "dtype"),
    cpu_case((130, 200), "dtype"),
    cpu_case((70, 260), "fp8_block"),
    cpu_case((70, 260), "fp8_row"),
    cpu_case((8, 64), "fp32_router"),
]
BATCHES = (1, 3, 17, 64)


def _weights(n, k, weights, device, gen):
    """(w, scale, x dtype, out dtype)"""
    w = torch.randn(n, k, generator=gen, device=device) / k**0.5
    dtype = model_dtype(device)
    if weights == "dtype":
        return w.to(dtype), None, dtype, dtype
    if weights == "fp32_router":
        return w, None, dtype, torch.float32
    wq, scale = quantize_weight_block(w)
    if weights == "fp8_row":
        scale = expand_scale_rows(scale, n)
    return wq, scale, dtype, dtype


def _poisoned_x(rows, k, dtype, device, gen):
    """[rows, K] view of a NaN buffer: each row's stride is K + 16 (NaN past K), NaN rows after."""
    buf = torch.full((rows + 4, k + 16), float("nan"), dtype=dtype, device=device)
    buf[:rows, :k] = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    return buf[:rows, :k]


def _check_close(got, ref):
    assert not got.isnan().any()
    g, r = got.float(), ref.float()
    eps = 1e-5 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps
    tol = eps * r.abs() + 1e-3 * r.abs().max()
    assert ((g - r).abs() <= tol).all(), (g - r).abs().max()


@pytest.mark.parametrize(("shape", "weights", "device"), [*CPU_CASES, *GPU_CASES])
def test_matches_fp32_reference_and_is_batch_invariant(shape, weights, device, monkeypatch):
    from mlaserve.ops.invariant_matmul import invariant_matmul

    if device == "cpu":
        row_invariant_interpreter_dot(monkeypatch)
    n, k = GPU_SHAPES.get(shape, shape)
    gen = torch.Generator(device=device).manual_seed(0)
    w, scale, x_dtype, out_dtype = _weights(n, k, weights, device, gen)
    x = _poisoned_x(64, k, x_dtype, device, gen)
    y = invariant_matmul(x, w, scale, out_dtype=out_dtype)
    assert y.shape == (64, n) and y.dtype == out_dtype
    _check_close(y, rowwise_matmul(x, w, scale, out_dtype=out_dtype))
    # Invariance on the fp32 accumulator itself (rounding to a 16-bit output would hide most
    # changes of summation order), and on the served output.
    y32 = invariant_matmul(x, w, scale, out_dtype=torch.float32)
    for m in BATCHES:
        for start in {0, 64 - m}:  # the same rows at another offset in their tile
            rows = slice(start, start + m)
            got = invariant_matmul(x[rows], w, scale, out_dtype=torch.float32)
            assert torch.equal(got, y32[rows]), (m, start)
            assert torch.equal(invariant_matmul(x[rows], w, scale, out_dtype=out_dtype), y[rows])
    # real rows beside garbage rows (padding to a graph bucket holds anything)
    garbage = torch.cat([x[:5], torch.full_like(x[:11], 1e3)]).contiguous()
    garbage[7] = float("nan")
    got = invariant_matmul(garbage, w, scale, out_dtype=torch.float32)
    assert torch.equal(got[:5], y32[:5])


@pytest.mark.parametrize(
    ("h", "n", "k", "transposed", "device"),
    [
        cpu_case(3, 24, 40, False),
        cpu_case(2, 48, 16, True),  # W_UK's layout: w[h] a transposed view
        gpu_case(16, 512, 16, True),  # default model W_UK: [T, 16, 16] -> [T, 16, 512]
        gpu_case(16, 16, 512, False),  # default model W_UV
        gpu_case(16, 512, 128, True),  # V3-lite W_UK
        gpu_case(16, 128, 512, False),  # V3-lite W_UV
    ],
)
def test_head_matmul_matches_reference_and_is_invariant(h, n, k, transposed, device):
    from mlaserve.ops.invariant_matmul import invariant_head_matmul

    gen = torch.Generator(device=device).manual_seed(1)
    dtype = model_dtype(device)
    if transposed:  # [H, K, N] storage read as [H, N, K]
        w = torch.randn(h, k, n, generator=gen, device=device).to(dtype).transpose(1, 2)
    else:
        w = torch.randn(h, n, k, generator=gen, device=device).to(dtype)
    buf = torch.full((70, h + 1, k), float("nan"), dtype=dtype, device=device)
    buf[:64, :h] = torch.randn(64, h, k, generator=gen, device=device).to(dtype)
    x = buf[:64, :h]  # head stride free, NaN head after the last
    y = invariant_head_matmul(x, w)
    _check_close(y, rowwise_head_matmul(x, w))
    for m in BATCHES:
        assert torch.equal(invariant_head_matmul(x[64 - m :], w), y[64 - m :]), m


def test_torch_form_is_batch_invariant():
    """The CPU path: one row at a time, so rows never see each other."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 33, generator=gen)
    x = torch.randn(17, 33, generator=gen)
    y = rowwise_matmul(x, w)
    for m in (1, 3, 17):
        assert torch.equal(rowwise_matmul(x[:m], w), y[:m])
    wh = torch.randn(3, 8, 33, generator=gen)
    xh = torch.randn(17, 3, 33, generator=gen)
    yh = rowwise_head_matmul(xh, wh)
    assert torch.equal(rowwise_head_matmul(xh[:1], wh), yh[:1])


def test_refuses_mismatched_operands():
    from mlaserve.ops.invariant_matmul import invariant_matmul

    with pytest.raises(ValueError, match="weight"):
        invariant_matmul(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="FP8"):
        invariant_matmul(torch.zeros(2, 8), torch.zeros(4, 8), torch.ones(1, 1))


# The deterministic mode's summation tree (`invariant_rowwise.TREE_LEAVES` leaves of K): row-
# parallel products at serving sizes. (N, K) of the default model's o_proj and dense MLP down,
# V3-lite's o_proj and V3's o_proj at TP1 (FP8 only; V3 ships FP8). FP8 leaves are multiples of
# 128 columns (K / 8 % 128 == 0): none of the default model's K qualifies.
TREE_SHAPES = {
    "default_o": (256, 256),
    "default_down": (256, 512),
    "v3lite_o": (2048, 2048),
    "v3_o": (7168, 16384),
    "ragged": (1000, 1400),  # leaves of 175 columns: a partial K step in every leaf
}
TREE_GPU_CASES = [
    gpu_case(shape, weights)
    for shape, weights in (
        ("default_o", "dtype"),
        ("default_down", "dtype"),
        ("v3lite_o", "dtype"),
        ("ragged", "dtype"),
        ("v3lite_o", "fp8_block"),
        ("v3lite_o", "fp8_row"),
        ("v3_o", "fp8_block"),
        ("default_o", "fp32_router"),  # the fp32 operands' tiles (an fp32 model's layers)
    )
]
TREE_CPU_CASES = [
    cpu_case((24, 256), "dtype"),
    cpu_case((70, 520), "dtype"),  # leaves of 65 columns, a partial N tile
    cpu_case((40, 1024), "fp8_block"),  # leaves of one 128-column scale block
    cpu_case((8, 256), "fp32_router"),
]


def _poisoned_copy(t: torch.Tensor) -> torch.Tensor:
    """t [M, K] copied into the leading rows and columns of a NaN buffer (a rank's own
    activations): a read past its K or its M shows as NaN."""
    buf = torch.full(
        (t.shape[0] + 4, t.shape[1] + 16), float("nan"), dtype=t.dtype, device=t.device
    )
    buf[: t.shape[0], : t.shape[1]] = t
    return buf[: t.shape[0], : t.shape[1]]


def _share(x, w, scale, r, n):
    """Rank r of n's operands of a row-parallel product: x's and w's K columns
    [r K/n, (r+1) K/n) (and their scale columns), each its own tensor."""
    k = x.shape[1]
    cols = slice(r * k // n, (r + 1) * k // n)
    s = None
    if scale is not None:
        s = scale[:, r * k // n // 128 : (r + 1) * k // n // 128].contiguous()
    return _poisoned_copy(x[:, cols]), w[:, cols].contiguous(), s


def _check_shares(matmul, x, w, scale, y):
    """`matmul(leaves=8)`'s fp32 output `y` is bitwise the tree of n rank shares' outputs with
    `leaves=8 // n`, n = 2, 4, 8."""
    from mlaserve.ops.invariant_rowwise import TREE_LEAVES, tree_sum

    for ranks in (2, 4, 8):
        leaves = TREE_LEAVES // ranks
        shares = [
            matmul(*_share(x, w, scale, r, ranks), out_dtype=torch.float32, leaves=leaves)
            for r in range(ranks)
        ]
        assert torch.equal(tree_sum(torch.stack(shares)), y), ranks


@pytest.mark.parametrize(("shape", "weights", "device"), [*TREE_CPU_CASES, *TREE_GPU_CASES])
def test_leaves_are_tensor_parallel_invariant(shape, weights, device, monkeypatch):
    """`leaves=8` (fp32 out) against `rowwise_matmul(leaves=8)`: |err| <= 1e-5 * (|x| @ |W|.T)
    per element (the same leaves and tree; only a leaf's own fp32 sum in another order).
    Bitwise: the tree of n rank shares (K split in n contiguous runs, `leaves=8 // n` each),
    n = 2, 4, 8; any subset of the rows (batch invariance); and the kernel's own rounding of the
    root (one rank) against the fp32 root rounded after the tree (`tree_all_reduce`)."""
    from mlaserve.ops.invariant_matmul import invariant_matmul
    from mlaserve.ops.invariant_rowwise import TREE_LEAVES, dequantized

    if device == "cpu":
        row_invariant_interpreter_dot(monkeypatch)
    n, k = TREE_SHAPES.get(shape, shape)
    gen = torch.Generator(device=device).manual_seed(3)
    w, scale, x_dtype, out_dtype = _weights(n, k, weights, device, gen)
    x = _poisoned_x(64, k, x_dtype, device, gen)
    y = invariant_matmul(x, w, scale, out_dtype=torch.float32, leaves=TREE_LEAVES)
    assert y.shape == (64, n) and y.dtype == torch.float32 and not y.isnan().any()
    ref = rowwise_matmul(x, w, scale, out_dtype=torch.float32, leaves=TREE_LEAVES)
    bound = 1e-5 * (x.float().abs() @ dequantized(w, scale).abs().T)
    assert ((y - ref).abs() <= bound).all(), ((y - ref).abs() / bound).max()
    _check_shares(invariant_matmul, x, w, scale, y)
    for m in (1, 3, 17):
        for start in {0, 64 - m}:
            rows = slice(start, start + m)
            got = invariant_matmul(x[rows], w, scale, out_dtype=torch.float32, leaves=TREE_LEAVES)
            assert torch.equal(got, y[rows]), (m, start)
    rounded = invariant_matmul(x, w, scale, out_dtype=out_dtype, leaves=TREE_LEAVES)
    assert torch.equal(rounded, y.to(out_dtype))


@pytest.mark.parametrize("weights", ["fp32", "fp8_block"])
def test_torch_form_leaves_are_tensor_parallel_invariant(weights):
    """The CPU path (`rowwise_matmul`): `leaves=8` equals, bitwise, the tree of n rank shares
    with `leaves=8 // n` (n = 2, 4, 8), and a row subset's bits; within 1e-5 * (|x| @ |W|.T) of
    the one fp32 sum (`leaves=1`)."""
    from mlaserve.ops.fp8_quant import quantize_weight_block
    from mlaserve.ops.invariant_rowwise import TREE_LEAVES, dequantized

    gen = torch.Generator().manual_seed(4)
    k = 1024 if weights == "fp8_block" else 200  # fp32: leaves of 25 columns
    w = torch.randn(150, k, generator=gen) / k**0.5
    scale = None
    if weights == "fp8_block":
        w, scale = quantize_weight_block(w)
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    y = rowwise_matmul(x, w, scale, out_dtype=torch.float32, leaves=TREE_LEAVES)
    _check_shares(rowwise_matmul, x, w, scale, y)
    assert torch.equal(rowwise_matmul(x[2:4], w, scale, out_dtype=torch.float32, leaves=8), y[2:4])
    one_sum = rowwise_matmul(x, w, scale, out_dtype=torch.float32)
    bound = 1e-5 * (x.float().abs() @ dequantized(w, scale).abs().T)
    assert ((y - one_sum).abs() <= bound).all()


def test_tree_sum_adds_adjacent_pairs_level_by_level():
    """`tree_sum` is ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), bitwise (at 8, 4, 2
    and 1 leaves), on values where the association changes the fp32 result: it differs from
    the left-to-right sum somewhere. `check_leaves` takes 1, 2, 4, 8 only."""
    from mlaserve.ops.invariant_rowwise import check_leaves, tree_sum

    gen = torch.Generator().manual_seed(5)
    # magnitudes over 2^-12 .. 2^12, both signs: fp32 sums lose low bits in order-dependent ways
    leaves = torch.randn(8, 4096, generator=gen) * torch.exp2(
        torch.randint(-12, 13, (8, 4096), generator=gen).float()
    )
    l0, l1, l2, l3, l4, l5, l6, l7 = leaves
    want = ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
    assert torch.equal(tree_sum(leaves), want)
    assert torch.equal(tree_sum(leaves[:4]), (l0 + l1) + (l2 + l3))
    assert torch.equal(tree_sum(leaves[:2]), l0 + l1)
    assert torch.equal(tree_sum(leaves[:1]), l0)
    sequential = l0
    for leaf in leaves[1:]:
        sequential = sequential + leaf
    assert not torch.equal(want, sequential)  # the values do tell the orders apart
    # the sum over ranks' subtrees is the same tree: the top levels over 2 or 4 subtree sums
    assert torch.equal(tree_sum(torch.stack([tree_sum(leaves[:4]), tree_sum(leaves[4:])])), want)
    assert torch.equal(tree_sum(torch.stack([tree_sum(p) for p in leaves.view(4, 2, -1)])), want)
    for good in (1, 2, 4, 8):
        check_leaves(good)
    for bad in (0, 3, 6, 16):
        with pytest.raises(ValueError, match="leaves"):
            check_leaves(bad)
    with pytest.raises(ValueError, match="leaves"):
        tree_sum(leaves[:3])
    with pytest.raises(ValueError, match="leaves"):
        tree_sum(torch.cat([leaves, leaves]))


def test_leaves_refuse_uneven_splits_and_a_bias():
    """invariant_matmul and rowwise_matmul: leaves not dividing 8, K not in equal leaves, FP8
    leaves not of whole 128-column scale blocks, and a bias with leaves (it belongs after the
    sum over ranks) are ValueErrors, raised before any launch."""
    from mlaserve.ops.fp8_quant import quantize_weight_block
    from mlaserve.ops.invariant_matmul import invariant_matmul

    x, w = torch.zeros(2, 512), torch.zeros(4, 512)
    wq, scale = quantize_weight_block(torch.ones(4, 512))
    for matmul in (invariant_matmul, rowwise_matmul):
        with pytest.raises(ValueError, match="leaves"):
            matmul(x, w, leaves=3)
        with pytest.raises(ValueError, match="leaves"):
            matmul(x, w, leaves=16)
        with pytest.raises(ValueError, match="leaves"):
            matmul(x[:, :12], w[:, :12], leaves=8)  # 12 columns in 8 leaves
        with pytest.raises(ValueError, match="bias"):
            matmul(x, w, bias=torch.zeros(4), leaves=2)
    with pytest.raises(ValueError, match="128"):
        invariant_matmul(x.half(), wq, scale, leaves=8)  # 64-column FP8 leaves
    with pytest.raises(ValueError, match="128"):
        invariant_matmul(x[:, :384].half(), wq[:, :384], scale[:, :3], leaves=2)  # 192
    # a bias with one leaf is the plain product's (no rows: nothing is launched)
    assert invariant_matmul(x[:0], w, bias=torch.zeros(4), leaves=1).shape == (0, 4)
