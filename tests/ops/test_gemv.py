"""The decode GEMV vs its fp32 reference: bf16 weights, FP8 weights with 128 x 128 block and
per-row scales, M = 1..16, N and K that are and are not multiples of 128 (partial row and K
blocks), the default tiles and forced ones (FP8 K steps narrower and wider than a scale block).

Everything past the operands is NaN: x, w and the scale are the leading rows of NaN-filled
buffers, so a read past K (the next row's start, or the poison after the last row) or past the
scale's columns turns outputs NaN or wrong. (Reads of rows past N or M feed only outputs that
are never stored, so they cannot show here.)

Tolerance: |got - ref| <= eps(dtype) * |ref| + 1e-3 * max |ref|: one unit in the last place of
the single rounding to the output dtype, plus fp32 accumulation in another order than torch's.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.ops.fp8_quant import expand_scale_rows, quantize_weight_block
from tests.ops.cases import cpu_case, gpu, gpu_case, model_dtype

# name: (N, K)
SHAPES = {
    "v2lite_q": (3072, 2048),
    "v2lite_kv_a": (576, 2048),  # N = 4.5 scale blocks
    "v2lite_q_kv_a": (3648, 2048),  # the merged pair (mla.py): its seam is 128-aligned
    "v2lite_o": (2048, 2048),
    "router": (64, 2048),
    "v3_q_a": (1536, 7168),
    "v3_q_b": (24576, 1536),
    "v3_o": (7168, 16384),
    "v3_tp2_o": (7168, 8192),  # one rank's o_proj at TP2: the FP8 long-K tile, one K step
    "ragged": (1000, 1400),  # partial N and K blocks at serving size
}
GPU_CASES = [
    gpu_case(m, shape, weights)
    for m in (1, 2, 3, 5, 8, 16)
    for shape in SHAPES
    for weights in ("dtype", "fp8_block", "fp8_row")
]
# (M, N, K, weights, config): few programs and K steps, the interpreter runs them one by one
CPU_CASES = [
    cpu_case(1, 24, 96, "dtype", None),  # the default tiles: one row per program
    cpu_case(3, 200, 300, "dtype", (64, 64, 4)),
    cpu_case(2, 48, 80, "fp32", (16, 32, 4)),
    cpu_case(5, 200, 300, "fp8_block", (32, 256, 4)),  # two scale columns per K step
    cpu_case(8, 130, 260, "fp8_row", (64, 32, 4)),  # four K steps per scale column
    cpu_case(2, 130, 260, "fp8_block", (128, 64, 4)),
    cpu_case(1, 1, 200, "fp8_block", (1, 128, 4)),  # N = 1: both scale forms are one row
    cpu_case(1, 6, 4096, "fp8_block", None),  # the FP8 long-K tile: 2 rows, the whole K a step
]
POISON_ROWS = 16


def _operands(m, n, k, weights, device, seed):
    """x [M, K], w [N, K], scale or None, each the leading rows of a NaN-filled buffer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.float32 if weights == "fp32" else model_dtype(device)
    x_buf = torch.full((m + POISON_ROWS, k), float("nan"), dtype=dtype, device=device)
    x_buf[:m] = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = torch.randn(n, k, generator=gen, device=device) / k**0.5
    scale = None
    if weights.startswith("fp8"):
        w_q, scale = quantize_weight_block(w)
        if weights == "fp8_row":
            scale = expand_scale_rows(scale, n)
        w_buf = torch.empty(n + POISON_ROWS, k, dtype=w_q.dtype, device=device)
        w_buf.view(torch.uint8)[n:] = 0x7F  # e4m3fn's NaN
        w_buf[:n] = w_q
        s_buf = torch.full((scale.shape[0] + POISON_ROWS, scale.shape[1]), float("nan"))
        s_buf = s_buf.to(device)  # quantize_weight_block's scale is on w's device
        s_buf[: scale.shape[0]] = scale
        scale = s_buf[: scale.shape[0]]
    else:
        w_buf = torch.full((n + POISON_ROWS, k), float("nan"), dtype=dtype, device=device)
        w_buf[:n] = w.to(dtype)
    return x_buf[:m], w_buf[:n], scale


def _check_close(got, want, dtype):
    assert not got.isnan().any()
    err = (got.float() - want).abs()
    bound = torch.finfo(dtype).eps * want.abs() + 1e-3 * want.abs().max()
    bad = err > bound
    assert not bad.any(), f"{int(bad.sum())} outputs off, worst {err.max():.3e}"


@pytest.mark.parametrize("m,shape,weights,device", GPU_CASES)
def test_gemv_matches_reference(m, shape, weights, device):
    from mlaserve.ops.gemv import gemv, gemv_reference

    n, k = SHAPES[shape]
    x, w, scale = _operands(m, n, k, weights, device, seed=m * 31 + n)
    got = gemv(x, w, scale)
    assert got.shape == (m, n) and got.dtype == x.dtype
    _check_close(got, gemv_reference(x, w, scale), x.dtype)
    assert torch.equal(gemv(x, w, scale), got)  # no atomics: the same bits every call


@pytest.mark.parametrize(
    "config", [(1, 2048, 8), (2, 1024, 8), (4, 512, 4), (8, 128, 4), (16, 64, 4), (32, 32, 2)]
)
@pytest.mark.parametrize("weights", ["dtype", "fp8_block", "fp8_row"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu, id="cuda")])
def test_gemv_forced_tiles(config, weights, device):
    """Tiles of every kind bench/gemv.py --sweep-configs may pick, at a ragged shape."""
    from mlaserve.ops.gemv import GemvConfig, gemv, gemv_reference

    x, w, scale = _operands(5, 1000, 1400, weights, device, seed=sum(config))
    got = gemv(x, w, scale, config=GemvConfig(*config))
    _check_close(got, gemv_reference(x, w, scale), x.dtype)


@pytest.mark.parametrize("m,device", [gpu_case(1), gpu_case(8), cpu_case(3)], ids=lambda v: str(v))
def test_gemv_fp32_weight_fp32_out(m, device):
    """The MoE router's form: 16-bit activations against an fp32 gate, fp32 logits (the
    reference casts x to fp32 first: the same products)."""
    from mlaserve.ops.gemv import gemv, gemv_reference

    n, k = (64, 2048) if device == "cuda" else (24, 96)
    x, _, _ = _operands(m, n, k, "dtype", device, seed=m)
    w = torch.randn(n, k, device=device) / k**0.5
    got = gemv(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    want = gemv_reference(x, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("m,n,k,weights,config,device", CPU_CASES)
def test_gemv_interpreted(m, n, k, weights, config, device):
    from mlaserve.ops.gemv import GemvConfig, gemv, gemv_reference

    x, w, scale = _operands(m, n, k, weights, device, seed=m + n + k)
    got = gemv(x, w, scale, config=None if config is None else GemvConfig(*config))
    assert got.shape == (m, n) and got.dtype == x.dtype
    _check_close(got, gemv_reference(x, w, scale), x.dtype)


def test_gemv_refuses_what_does_not_fit():
    from mlaserve.ops.gemv import GEMV_MAX_M, GemvConfig, gemv

    x, w = torch.zeros(2, 256, dtype=torch.float16), torch.zeros(64, 256, dtype=torch.float16)
    w8, s8 = torch.zeros(64, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2)
    cases = [
        ((x.int(), w, None), "x is"),
        ((x, w.bfloat16(), None), "w is"),
        ((x[0], w, None), "2-D"),
        ((x, w[:, :128].contiguous(), None), "differ in K"),
        ((torch.zeros(GEMV_MAX_M + 1, 256, dtype=x.dtype), w, None), "GEMV_MAX_M"),
        ((torch.zeros(256, 2, dtype=x.dtype).t(), w, None), "contiguous"),
        ((x, torch.zeros(256, 64, dtype=x.dtype).t(), None), "contiguous"),
        ((x, w, s8), "FP8 only"),
        ((x, w8, None), "need w_scale"),
        ((x, w8, torch.ones(2, 2)), r"expected \[1 \(128-row blocks\) or 64 \(per row\), 2\]"),
        ((x, w8, torch.ones(1, 3)), "w_scale"),
        ((x, w8, s8.double()), "fp32"),
        ((x, w8, torch.ones(2, 64).t()), "contiguous"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            gemv(*args)
    with pytest.raises(ValueError, match="block_n = 3"):
        gemv(x, w, config=GemvConfig(3, 64, 4))
    with pytest.raises(ValueError, match="block_k = 8"):
        gemv(x, w, config=GemvConfig(16, 8, 4))
    assert gemv(x[:0], w).shape == (0, 64)  # no launch


def test_gemv_config_covers_the_sms():
    from mlaserve.ops.gemv import gemv_config

    assert gemv_config(1, 576, 2048, fp8=False).block_n == 1  # 576 programs, not 36
    assert gemv_config(1, 24576, 1536, fp8=True).block_n == 16
    assert gemv_config(1, 7168, 8192, fp8=True) == (2, 8192, 4)  # FP8 long K (FP8_LONG_K)
    assert gemv_config(1, 7168, 16384, fp8=True) == (2, 8192, 4)
    assert gemv_config(2, 7168, 8192, fp8=True) != (2, 8192, 4)  # one token only
    for m in (1, 2, 4, 8, 16):
        for n, k in SHAPES.values():
            for fp8 in (False, True):
                cfg = gemv_config(m, n, k, fp8, num_sms=132)
                assert -(-n // cfg.block_n) >= 3 * 132 or cfg.block_n == 1
                assert 16 <= cfg.block_k <= max(16, 2 * k)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu, id="cuda")])
def test_warm_up_compiles_every_bucket(device):
    """After `gemv_warm_up_tasks(max_m=5)` ran, calls at every M up to 5 compile nothing (M is a
    runtime value within a power-of-two bucket): what keeps compiles out of serving."""
    from mlaserve.graph_runner.compile_watch import CompileWatch
    from mlaserve.ops.gemv import gemv, gemv_warm_up_tasks

    w = torch.randn(136, 264, device=device, dtype=torch.bfloat16)  # a shape no other test has
    for task in gemv_warm_up_tasks(w, None, 5, torch.bfloat16):
        task()
    watch = CompileWatch()
    watch.mark_ready()
    for m in range(1, 6):
        gemv(torch.randn(m, 264, device=device, dtype=torch.bfloat16), w)
    assert watch.compiles_since_ready == 0
    gemv(torch.randn(9, 264, device=device, dtype=torch.bfloat16), w)  # bucket 16: not warmed
    assert watch.compiles_since_ready == 1


def test_warm_up_tasks_one_per_bucket(monkeypatch):
    """`gemv_warm_up_tasks`: one task per M bucket (powers of two, the last clipped to max_m),
    each one call at its bucket's largest M; none for max_m 0. Calls recorded, not run (CPU)."""
    from mlaserve.ops import gemv as module

    ran = []
    monkeypatch.setattr(module, "gemv", lambda x, w, s, out_dtype=None: ran.append(x.shape))
    w = torch.zeros(32, 64)
    assert module.gemv_warm_up_tasks(w, None, 0, torch.float32) == []
    for max_m, ms in ((5, [1, 2, 4, 5]), (16, [1, 2, 4, 8, 16]), (40, [1, 2, 4, 8, 16])):
        ran.clear()
        tasks = module.gemv_warm_up_tasks(w, None, max_m, torch.float32)
        assert len(tasks) == len(ms)
        for task in tasks:
            task()
        assert ran == [(m, 64) for m in ms]
