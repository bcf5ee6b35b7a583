"""FP8 block quantisation and block-scaled GEMMs (mlaserve/ops) against float64 oracles.

CPU: the torch reference math, the block -> expert map, the GEMM dispatch contract for SM90 and
SM100. GPU (marked gpu): the Triton kernels and torch's blockwise scaled_mm at V2-Lite-like
shapes, and that none of it synchronises with the host (it runs inside a captured CUDA graph).
Triton kernels on CPU through TRITON_INTERPRET: test_fp8_triton_interpret.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from mlaserve.ops.fp8_gemm import (
    W8A16_MAX_M,
    W8A16_MIN_M,
    block_fp8_linear,
    block_fp8_matmul_reference,
    choose_gemm,
    flashinfer_available,
)
from mlaserve.ops.fp8_grouped_gemm import align_blocks, grouped_block_fp8_linear
from mlaserve.ops.fp8_quant import (
    FP8_DTYPE,
    dequantize_weight_block,
    expand_scale_rows,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_torch,
    quantize_weight_block,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# A GEMM over the quantised operands vs the float64 product of the same operands: only the
# kernel's fp32 accumulation and the bf16 output rounding (2^-8) differ.
GEMM_MAX_REL = 1e-2
# The quantisation itself (what the weights/activations lose): e4m3 has 3 mantissa bits, so one
# rounding is <= 2^-4 relative per element; a GEMM's relative error (max over outputs / max |y|)
# on Gaussian data measured 0.02-0.04 (measurements.md: 3.7e-2 for torch's blockwise).
QUANT_GEMM_MAX_REL = 0.08


def test_weight_block_round_trip_is_one_e4m3_rounding() -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in [(256, 384), (72, 200), (1, 5)]:
        w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, k)  # blocks of very mixed range
        q, s = quantize_weight_block(w)
        assert q.dtype == FP8_DTYPE and list(s.shape) == [-(-n // 128), -(-k // 128)]
        back = dequantize_weight_block(q, s)
        blk_max = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k] * 448
        # |error| <= half an e4m3 step at the element's magnitude, and subnormals near 0
        bound = torch.maximum(w.abs() * 2**-4, blk_max * 2**-9)
        assert ((back - w).abs() <= bound).all(), (n, k)


def test_zero_groups_quantise_to_zero() -> None:
    x = torch.zeros(2, 256)
    x[1, 128:] = torch.linspace(-1, 1, 128)
    q, s = per_token_group_quant_fp8_torch(x)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (q[0].float() == 0).all() and (q[1, :128].float() == 0).all()


def test_per_row_scales_mean_the_same_weight() -> None:
    w = torch.randn(200, 130)
    q, s = quantize_weight_block(w)
    rows = expand_scale_rows(s, 200)
    assert list(rows.shape) == [200, 2]
    assert torch.equal(dequantize_weight_block(q, rows), dequantize_weight_block(q, s))


def test_emulated_linear_is_the_float64_product_of_its_operands() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 300, generator=g), torch.randn(130, 300, generator=g)
    q, s = quantize_weight_block(w)
    y = block_fp8_linear(x, q, s, backend="emulated")
    x_q, x_s = per_token_group_quant_fp8_torch(x)
    ref = block_fp8_matmul_reference(x_q, x_s, q, s)
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    exact = x.double() @ w.double().t()
    assert ((y.double() - exact).abs().max() / exact.abs().max()) < QUANT_GEMM_MAX_REL


def test_align_blocks_layout() -> None:
    counts = torch.tensor([3, 0, 6, 0, 2], dtype=torch.int32)
    rows, experts = align_blocks(counts, 11, 4)
    # 5 experts, 11 rows: bound ceil((11 + 5 * 3) / 4) = 7 blocks
    assert experts.tolist() == [0, 2, 2, 4, -1, -1, -1]
    assert rows.view(7, 4).tolist()[:4] == [
        [0, 1, 2, 11],
        [3, 4, 5, 6],
        [7, 8, 11, 11],
        [9, 10, 11, 11],
    ]
    # every row exactly once, in a block of its own expert
    row_expert = torch.repeat_interleave(torch.arange(5), counts.long())
    for b, e in enumerate(experts.tolist()):
        for r in rows[b * 4 : (b + 1) * 4].tolist():
            if r < 11:
                assert row_expert[r] == e
    assert sorted(r for r in rows.tolist() if r < 11) == list(range(11))


def test_grouped_emulated_matches_per_expert_reference() -> None:
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([2, 0, 5], dtype=torch.int32)
    x, w = torch.randn(7, 200, generator=g), torch.randn(3, 96, 200, generator=g)
    q, s = quantize_weight_block(w)
    y = grouped_block_fp8_linear(x, counts, q, s, emulated=True)
    x_q, x_s = per_token_group_quant_fp8_torch(x)
    for e, (lo, hi) in enumerate([(0, 2), (2, 2), (2, 7)]):
        ref = block_fp8_matmul_reference(x_q[lo:hi], x_s[lo:hi], q[e], s[e])
        torch.testing.assert_close(y[lo:hi].double(), ref, rtol=1e-5, atol=1e-5)


def test_grouped_emulated_w8a16_is_the_unquantised_rows_times_the_weight() -> None:
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([2, 0, 5], dtype=torch.int32)
    x, w = torch.randn(7, 200, generator=g), torch.randn(3, 96, 200, generator=g)
    q, s = quantize_weight_block(w)
    y = grouped_block_fp8_linear(x, counts, q, s, emulated=True, w8a16=True)
    for e, (lo, hi) in enumerate([(0, 2), (2, 2), (2, 7)]):
        ref = x[lo:hi].double() @ dequantize_weight_block(q[e], s[e], torch.float64).t()
        torch.testing.assert_close(y[lo:hi].double(), ref, rtol=1e-5, atol=1e-5)


def test_gemm_dispatch_contract_sm90() -> None:
    """SM90: the W8A16 Triton GEMM up to W8A16_MAX_M (one launch, no activation quantisation),
    the W8A8 Triton GEMM above it for every shape torch's blockwise kernel cannot take; torch's
    blockwise scaled_mm (cuBLASLt VEC128 x BLK128x128) for prefill-sized M."""
    assert choose_gemm(9, 1, 2048, 2048, 16) == "triton_w8a16"  # one token: the decode kernel
    assert choose_gemm(9, W8A16_MIN_M, 2048, 2048, 16) == "triton_w8a16"
    assert choose_gemm(9, W8A16_MAX_M, 2816, 2048, 22) == "triton_w8a16"
    assert choose_gemm(9, W8A16_MAX_M + 1, 2816, 2048, 22) == "triton"
    assert choose_gemm(9, 2048, 4096, 2048, 32) == "torch_blockwise"
    # torch wants the activation scales' columns exactly M apart: 4-row alignment needs 4 | M
    assert choose_gemm(9, 257, 2816, 2048, 22) == "triton"
    assert choose_gemm(9, 2048, 576, 2048, 5) == "triton"  # partial last block (kv_a)
    assert choose_gemm(9, 2048, 256, 2048, 256) == "triton"  # per-row scales
    assert choose_gemm(9, 2048, 2048, 1408 + 64, 12) == "triton"  # K not a multiple of 128
    assert choose_gemm(8, 2048, 4096, 2048, 32) == "triton"  # SM89: no blockwise cuBLAS


def test_gemm_dispatch_contract_sm100() -> None:
    """SM100: cuBLASLt's 128x128 block modes are SM90-only, so never torch's blockwise path;
    flashinfer's trtllm block-FP8 GEMM where installed and the shape fits, else Triton."""
    for m in (1, 64, 2048):
        assert choose_gemm(10, m, 4096, 2048, 32, has_flashinfer=True) == "flashinfer"
    assert choose_gemm(10, 64, 4096, 2048, 32, has_flashinfer=False) == "triton_w8a16"
    assert choose_gemm(10, 2048, 4096, 2048, 32, has_flashinfer=False) == "triton"
    assert choose_gemm(10, 8, 4096, 128, 32, has_flashinfer=True) == "triton_w8a16"  # K < 256
    assert choose_gemm(10, 80, 576, 2048, 5, has_flashinfer=True) == "triton"  # partial block
    fp32 = torch.float32
    assert choose_gemm(10, 80, 4096, 2048, 32, fp32, has_flashinfer=True) == "triton"


def test_flashinfer_call_matches_its_api() -> None:
    """The call block_fp8_linear makes on SM100 binds to flashinfer's real signature."""
    pytest.importorskip("flashinfer")
    from flashinfer.gemm import gemm_fp8_nt_groupwise

    sig = inspect.signature(gemm_fp8_nt_groupwise)
    sig.bind("x_q", "w_q", "x_s", "w_s", out_dtype=torch.bfloat16, backend="trtllm")
    assert "trtllm" in str(sig.parameters["backend"].annotation)


# ----- GPU -----

SHAPES = [
    (1, 2048, 2048),
    (8, 576, 2048),
    (32, 2816, 2048),
    (64, 2048, 1408),
    (300, 3072, 1536),
    (2048, 4096, 2048),
]


@gpu
@pytest.mark.gpu
def test_quant_kernel_matches_torch_reference() -> None:
    x = torch.randn(37, 1000, device="cuda", dtype=torch.bfloat16) * 3
    q, s = per_token_group_quant_fp8(x)
    q_ref, s_ref = per_token_group_quant_fp8_torch(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # same fp32 division and round-to-nearest-even: identical codes but for ties at 1 ulp
    diff = (q.float() - q_ref.float()).abs()
    assert (diff <= q_ref.float().abs() * 2**-3).all() and (diff > 0).float().mean() < 1e-3


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("backend", ["triton_w8a16", "triton", "torch_blockwise", "flashinfer"])
def test_gemm_vs_float64(m: int, n: int, k: int, backend: str) -> None:
    major = torch.cuda.get_device_capability()[0]
    if backend == "torch_blockwise" and (major != 9 or m < 16 or n % 128 or k % 512):
        pytest.skip("torch's blockwise recipe: SM90, M >= 16 (rejects M=1), N, K % 128 == 0")
    if backend == "flashinfer" and (major != 10 or not flashinfer_available() or n % 128):
        pytest.skip("flashinfer's block-FP8 GEMM: SM100 with flashinfer, N % 128 == 0")
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    q, s = quantize_weight_block(w)
    y = block_fp8_linear(x, q, s, backend=backend)
    if backend == "triton_w8a16":  # unquantised activations times the block-FP8 weight
        ref = x.double() @ dequantize_weight_block(q, s, torch.float64).t()
    else:
        x_q, x_s = per_token_group_quant_fp8_torch(x)
        ref = block_fp8_matmul_reference(x_q, x_s, q, s)
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < GEMM_MAX_REL, f"{backend} {m}x{n}x{k}: {err:.2e}"
    exact = x.double() @ w.double().t()
    assert ((y.double() - exact).abs().max() / exact.abs().max()) < QUANT_GEMM_MAX_REL


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("rows", "per_row", "w8a16"),
    [
        (6, False, True),
        (6, False, False),
        (48, True, True),
        (48, True, False),
        (2048, False, False),
    ],
)
def test_grouped_gemm_vs_float64(rows: int, per_row: bool, w8a16: bool) -> None:
    """64 experts, V2-Lite's expert shape (gate_up 2816 x 2048), rows routed at random."""
    num_e, n, k = 64, 2816, 2048
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(num_e, n, k, device="cuda", generator=g) * 0.05
    q, s = quantize_weight_block(w)
    if per_row:
        s = expand_scale_rows(s, n)
    ids = torch.randint(0, num_e, (rows,), device="cuda", generator=g).sort().values
    counts = torch.bincount(ids, minlength=num_e).to(torch.int32)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    y = grouped_block_fp8_linear(x, counts, q, s, w8a16=w8a16)
    x_q, x_s = per_token_group_quant_fp8_torch(x)
    ref = torch.empty(rows, n, dtype=torch.float64, device="cuda")
    bounds = [0, *counts.cumsum(0).tolist()]
    for e in range(num_e):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo and w8a16:
            ref[lo:hi] = x[lo:hi].double() @ dequantize_weight_block(q[e], s[e], torch.float64).t()
        elif hi > lo:
            ref[lo:hi] = block_fp8_matmul_reference(x_q[lo:hi], x_s[lo:hi], q[e], s[e])
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < GEMM_MAX_REL, f"rows {rows}: {err:.2e}"


@gpu
@pytest.mark.gpu
def test_kernels_capture_in_a_cuda_graph() -> None:
    """Quantisation, dense and grouped GEMM dispatch read nothing back: they capture, and a
    replay on new inputs gives the eager result."""
    num_e, n, k = 8, 256, 512
    wq, ws = quantize_weight_block(torch.randn(n, k, device="cuda"))
    eq, es = quantize_weight_block(torch.randn(num_e, n, k, device="cuda"))
    x = torch.randn(6, k, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([1, 0, 2, 0, 0, 3, 0, 0], device="cuda", dtype=torch.int32)

    def step() -> tuple[torch.Tensor, ...]:
        return (
            block_fp8_linear(x, wq, ws),  # W8A16 at 6 rows
            block_fp8_linear(x[:1], wq, ws),  # W8A8 at 1 row
            block_fp8_linear(x, wq, ws, backend="triton"),  # W8A8: quantisation + split-K
            grouped_block_fp8_linear(x, counts, eq, es),  # W8A16
            grouped_block_fp8_linear(x, counts, eq, es, w8a16=False),
        )

    step()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x))
    counts.copy_(torch.tensor([0, 3, 0, 0, 1, 0, 2, 0], device="cuda", dtype=torch.int32))
    graph.replay()
    expected = step()
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_warm_up_token_counts_cover_every_triton_variant() -> None:
    """`FP8_WARM_UP_TOKENS`, one count per Triton variant `block_fp8_linear` takes on SM90 past
    the decode GEMV: the W8A16 decode kernel, the W8A16 GEMM's 32- and 64-row tiles, W8A8, and
    the blockwise GEMM (its activation quantisation). The kernels take M unspecialised, so a
    count stands for its range; no token count runs a variant the counts miss. On the CPU
    (the emulated GEMM) there are no tasks."""
    from mlaserve.ops.fp8_gemm import FP8_WARM_UP_TOKENS, fp8_gemm_warm_up_tasks

    def variant(m: int) -> tuple:
        backend = choose_gemm(9, m, 7168, 8192, 56)
        tile = None if backend != "triton_w8a16" else (16 if m <= 16 else 32 if m <= 32 else 64)
        return backend, tile

    warmed = [variant(m) for m in FP8_WARM_UP_TOKENS]
    assert len(set(warmed)) == len(warmed) == 5
    assert {variant(m) for m in range(2, 4097)} == set(warmed)
    q, s = quantize_weight_block(torch.randn(256, 512))
    assert fp8_gemm_warm_up_tasks(q, s, torch.float32) == []


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_warm_up_leaves_no_compile_to_any_token_count(out_dtype) -> None:
    """After `fp8_gemm_warm_up_tasks` ran, `block_fp8_linear` at token counts of every range and
    remainder mod 16 (a VERIFY of 21 rows, a prefill chunk of 100 or 260) compiles nothing: the
    compile watch stays at 0 (a Triton compile while serving stalls every request for ~1 s)."""
    from mlaserve.graph_runner.compile_watch import CompileWatch
    from mlaserve.ops.fp8_gemm import fp8_gemm_warm_up_tasks

    g = torch.Generator(device="cuda").manual_seed(3)
    n, k = 1408, 2560  # a shape no other test has: its variants are not built yet
    q, s = quantize_weight_block(torch.randn(n, k, device="cuda", generator=g) * 0.05)
    for task in fp8_gemm_warm_up_tasks(q, s, torch.bfloat16, out_dtype):
        task()
    watch = CompileWatch()
    watch.mark_ready()
    for m in (3, 7, 16, 21, 32, 40, 48, 63, 64, 66, 80, 100, 255, 256, 260, 300, 513):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        block_fp8_linear(x, q, s, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert watch.compiles_since_ready == 0
