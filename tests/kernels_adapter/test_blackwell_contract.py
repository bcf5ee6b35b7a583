"""Contract tests of the Blackwell backends (tokenspeed, trtllm) on a CPU, against the REAL
installed kernel packages (`pip install '.[contract]'`; skipped at collection without them).

No kernel runs here (they need an SM100 GPU, which we do not have). What is checked:
  * every call's keyword arguments, as the adapter builds them, bind to the real function's
    `inspect.signature` (names, nothing missing, nothing extra);
  * the tensors satisfy what the packages state or assert: dtypes, shapes, contiguity,
    alignment, workspace size (against the package's own size function where it has one), and
    flashinfer's own CPU-side validators accept them;
  * the arguments mean the right thing: a plain-torch reading of the kernel's documented
    semantics, applied to the adapter's arguments, reproduces the reference backend (so scale
    folding, page tables, sequence lengths and ragged offsets are right), within 1e-5 when fed
    the same rounded query;
  * constraint errors, backend choice by compute capability and KV dtype, the cubin check.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import pytest
import torch

tokenspeed_mla = pytest.importorskip("tokenspeed_mla")
flashinfer = pytest.importorskip("flashinfer")

from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla  # noqa: E402
from flashinfer.mla._core import _check_trtllm_gen_mla_shape  # noqa: E402
from flashinfer.prefill import trtllm_ragged_attention_deepseek  # noqa: E402
from flashinfer.utils import (  # noqa: E402
    _check_workspace_buffer_alignment,
    _resolve_trtllm_gen_multi_ctas_kv_counter_buffer,
    get_trtllm_gen_multi_ctas_kv_counter_bytes,
)
from tokenspeed_mla import mla_decode as ts_decode_module  # noqa: E402
from tokenspeed_mla.mla_decode import tokenspeed_mla_decode  # noqa: E402
from tokenspeed_mla.mla_helpers import (  # noqa: E402
    compute_q_tile_layout,
    get_mla_decode_fold_sq_factor,
    select_mla_decode_tilers,
)
from tokenspeed_mla.mla_prefill import tokenspeed_mla_prefill  # noqa: E402

from mlaserve.engine.forward_batch import ForwardMode  # noqa: E402
from mlaserve.kernels_adapter import BackendUnsupportedError, resolve_backend_name  # noqa: E402
from mlaserve.kernels_adapter.gpu_target import GpuTarget  # noqa: E402
from mlaserve.kernels_adapter.mha_extend import causal_varlen_attention  # noqa: E402
from mlaserve.kernels_adapter.tokenspeed import TokenspeedBackend, workspace_bytes  # noqa: E402
from mlaserve.kernels_adapter.trtllm import (  # noqa: E402
    WORKSPACE_BYTES,
    TrtllmBackend,
    missing_cubins,
    padded_table_width,
)
from tests.kernels_adapter.blackwell_problem import (  # noqa: E402
    CPU,
    HEADS,
    MAX_MODEL_LEN,
    PREFIX,
    Q_LENS,
    RANK,
    ROPE,
    decode_by_semantics,
    deepseek_config,
    e4m3,
    extend_inputs,
    make_problem,
    reference_decode,
    reference_extend,
    rel_err,
)

B200 = GpuTarget(capability=(10, 0), num_sms=148)


def bind(fn, kwargs: dict) -> inspect.BoundArguments:
    """Bind exactly as the adapter calls: fn(**kwargs). Fails on unknown or missing names."""
    bound = inspect.signature(fn).bind(**kwargs)
    bound.apply_defaults()
    return bound


def tokenspeed(kv_dtype=torch.float8_e4m3fn, page_size=64, max_q_len=4, **kw):
    return TokenspeedBackend(
        deepseek_config(**kw), page_size, kv_dtype, CPU, 8, MAX_MODEL_LEN,
        max_q_len=max_q_len, target=B200,
    )  # fmt: skip


def trtllm(kv_dtype=torch.float8_e4m3fn, page_size=64, max_q_len=4, **kw):
    return TrtllmBackend(
        deepseek_config(**kw), page_size, kv_dtype, CPU, 8, MAX_MODEL_LEN,
        max_q_len=max_q_len, target=B200,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# tokenspeed: decode / verify
# --------------------------------------------------------------------------------------------


def tokenspeed_package_workspace(
    bs: int, q_len: int, heads: int, target: GpuTarget, max_seq_len: int
) -> int:
    """The workspace `tokenspeed_mla_decode` slices for a call: its own dispatch (tilers, fold,
    packing) and its own size function, for a contiguous fp8 query."""
    tiler, _ = select_mla_decode_tilers(
        heads, q_len, is_fp8=True, compute_capability=target.capability
    )
    fold = get_mla_decode_fold_sq_factor(heads, q_len, tiler[0])
    h_eff, q_eff = heads * fold, q_len // fold
    if tiler[0] == 128 and -(-heads * q_len // tiler[0]) < q_eff:  # pack_q
        _, q_eff, _ = compute_q_tile_layout(heads, q_len, tiler[0])
        h_eff = tiler[0]
    _, size = ts_decode_module._get_split_kv_and_workspace_size(
        bs, q_eff, h_eff, RANK, target.num_sms, max_seq_len, torch.float8_e4m3fn, tiler, 1
    )
    return size


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("q_len", [1, 3])
def test_tokenspeed_decode_arguments(page_size: int, q_len: int) -> None:
    backend = tokenspeed(page_size=page_size)
    problem = make_problem(backend, [10, 0, 130, 63], [q_len] * 4, page_size, torch.float8_e4m3fn)
    batch = problem.batch
    backend.prepare(batch)
    rows = problem.new_rows
    batch.kv_pool.write(0, batch.slot_mapping, rows[:, :RANK], rows[:, RANK:])
    q = torch.randn(batch.num_tokens, HEADS, RANK + ROPE)
    kw = backend.decode_kwargs(0, q[..., :RANK], q[..., RANK:], batch)
    bound = bind(tokenspeed_mla_decode, kw)
    assert bound.arguments["out"] is None and bound.arguments["min_split_kv"] == 1

    query, cache = kw["query"], kw["kv_cache"]
    assert query.shape == (4, q_len, HEADS, RANK + ROPE)
    assert query.dtype == cache.dtype == torch.float8_e4m3fn  # the kernel asserts equality
    assert query.is_contiguous() and query.data_ptr() % 16 == 0  # 16B-aligned halves
    assert query.stride(1) == HEADS * query.stride(2)  # allows packed M128 rows
    assert cache.data_ptr() == batch.kv_pool.kv_buffers[0].data_ptr()  # the pool, no copy
    assert cache.shape == (batch.kv_pool.num_pages, page_size, RANK + ROPE)
    tables = kw["block_tables"]
    assert tables.dtype == torch.int32 and tables.dim() == 2 and tables.is_contiguous()
    assert tables.shape[0] == 4
    assert kw["seq_lens"].dtype == torch.int32  # anything else costs a .to() per call
    assert kw["seq_lens"].tolist() == [10 + q_len, q_len, 130 + q_len, 63 + q_len]  # incl. new
    assert type(kw["max_seq_len"]) is int and kw["max_seq_len"] == MAX_MODEL_LEN
    for key in ("softmax_scale", "output_scale"):
        assert type(kw[key]) is float
    ws = kw["workspace_buffer"]
    assert ws.dtype == torch.int8 and ws.dim() == 1 and ws.data_ptr() % 32 == 0
    assert ws.numel() >= tokenspeed_package_workspace(4, q_len, HEADS, B200, MAX_MODEL_LEN)
    # The package's own (cached) constraint check for this configuration.
    ts_decode_module._check_can_implement(
        torch.float8_e4m3fn, page_size, HEADS, q_len, RANK, ROPE, False, True, False, (10, 0)
    )
    # Semantics: fold scales right (k_scale 0.5 here) and the reference agrees to 1e-5.
    got = decode_by_semantics(kw, "softmax_scale", "output_scale")
    ref = reference_decode(problem, e4m3(q).float())  # the query the kernel gets
    assert rel_err(got.reshape(ref.shape), ref) < 1e-5


@pytest.mark.parametrize("heads", [16, 32, 64, 128])  # per rank: V3 at TP 8 / 4 / 2 / 1
@pytest.mark.parametrize("target", [B200, GpuTarget((10, 3), 148), GpuTarget((10, 7), 160)])
def test_tokenspeed_workspace_bound_covers_the_package(heads: int, target: GpuTarget) -> None:
    """The closed form `workspace_bytes` vs the package's own size, for every batch size and
    q_len the engine can use with `heads` heads a rank (up to 8 at 16 heads), short and long
    contexts."""
    worst = 0.0
    for max_q_len in sorted({1, 2, 4, TokenspeedBackend.max_q_len_for(heads)}):
        bound = workspace_bytes(target.num_sms, heads, max_q_len, RANK)
        for q_len in range(1, max_q_len + 1):
            for bs in (1, 2, 3, 4, 8, 16, 24, 32, 64, 128, 256):
                for max_seq_len in (64, 1000, 8192, 163840):
                    need = tokenspeed_package_workspace(bs, q_len, heads, target, max_seq_len)
                    assert need <= bound, (bs, q_len, max_seq_len, need, bound)
                    worst = max(worst, need / bound)
    # Not a wild overestimate either: measured 1.0 (tight) for H16 on SM100, 0.49-0.5 elsewhere.
    assert worst > 0.4


def test_tokenspeed_workspace_is_allocated_once_for_max_q_len() -> None:
    b1, b4 = tokenspeed(max_q_len=1), tokenspeed(max_q_len=4)
    assert b1.workspace.numel() == 148 * HEADS * 1 * 513 * 4
    assert b4.workspace.numel() == 4 * b1.workspace.numel()
    problem = make_problem(b1, [5], [2], 64, torch.float8_e4m3fn)  # EXTEND-shaped (2 > 1)
    problem.batch.mode = ForwardMode.VERIFY
    problem.batch.seq_lens_host = problem.batch.q_lens_host = None
    with pytest.raises(ValueError, match="sized for"):
        b1.prepare(problem.batch)


# --------------------------------------------------------------------------------------------
# tokenspeed: prefill (MHA form)
# --------------------------------------------------------------------------------------------


def test_tokenspeed_prefill_arguments() -> None:
    backend = tokenspeed()
    problem = make_problem(backend, PREFIX, Q_LENS, 64, torch.float8_e4m3fn)
    batch = problem.batch
    assert batch.mode is ForwardMode.EXTEND
    before = batch.kv_pool.kv_buffers[0].view(torch.uint8).clone()
    backend.prepare(batch)
    q, w_uk, w_uv = extend_inputs(problem)
    rows = problem.new_rows
    kw = backend.prefill_kwargs(0, q, rows[:, :RANK], rows[:, RANK:], w_uk, w_uv, batch)
    bind(tokenspeed_mla_prefill, kw)

    t, s = sum(Q_LENS), sum(p + n for p, n in zip(PREFIX, Q_LENS))
    shapes = {"query": (t, HEADS, 192), "key": (s, HEADS, 192), "value": (s, HEADS, 128)}
    for name, shape in shapes.items():
        x = kw[name]
        assert x.shape == shape and x.dtype == torch.float8_e4m3fn  # "only FP8 e4m3" for MLA
        assert x.is_contiguous() and x.data_ptr() % 16 == 0  # the TMA ignores strides
    for name in ("cum_seq_lens", "cum_seq_lens_q", "seq_lens"):
        assert kw[name].dtype == torch.int32 and kw[name].is_contiguous()
    assert kw["cum_seq_lens"].tolist() == [0, 37, 127, 133]
    assert kw["cum_seq_lens_q"].tolist() == [0, 37, 57, 58]
    assert kw["seq_lens"].tolist() == [37, 90, 6]
    assert (kw["max_seq_len"], kw["max_seq_len_q"], kw["batch_size"]) == (90, 37, 3)
    assert type(kw["softmax_scale"]) is float and kw["is_causal"] is True
    assert kw["return_lse"] is True  # the variant warmup_compile_prefill compiles

    # Semantics: the ragged problem the kernel gets, read back, is the reference's (to the fp8
    # rounding of Q, K, V; measured 4.5e-2 here, fixed seeds).
    got = causal_varlen_attention(
        kw["query"].float(), kw["key"].float(), kw["value"].float(), batch.attn_metadata,
        kw["softmax_scale"],
    )  # fmt: skip
    ref = reference_extend(problem, q, w_uk, w_uv, before)
    assert rel_err(got, ref) < 6e-2


# --------------------------------------------------------------------------------------------
# trtllm: decode / verify
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_dtype", "page_size", "q_len"),
    [
        (torch.float8_e4m3fn, 64, 1),
        (torch.float8_e4m3fn, 32, 3),
        (torch.bfloat16, 64, 2),
        (torch.bfloat16, 32, 1),
    ],
)
def test_trtllm_decode_arguments(kv_dtype: torch.dtype, page_size: int, q_len: int) -> None:
    backend = trtllm(kv_dtype=kv_dtype, page_size=page_size)
    problem = make_problem(backend, [10, 0, 130, 63], [q_len] * 4, page_size, kv_dtype)
    batch = problem.batch
    backend.prepare(batch)
    rows = problem.new_rows
    batch.kv_pool.write(0, batch.slot_mapping, rows[:, :RANK], rows[:, RANK:])
    q = torch.randn(batch.num_tokens, HEADS, RANK + ROPE)
    kw = backend.decode_kwargs(0, q[..., :RANK], q[..., RANK:], batch)
    bind(trtllm_batch_decode_with_kv_cache_mla, kw)

    query = kw["query"]
    assert query.dtype == kv_dtype == kw["kv_cache"].dtype  # no bf16-q / fp8-kv mode for MLA
    assert query.shape == (4, q_len, HEADS, RANK + ROPE) and query.is_contiguous()
    tables = kw["block_tables"]
    assert tables.dtype == torch.int32 and tables.is_contiguous()
    assert tables.shape == (4, padded_table_width(MAX_MODEL_LEN, page_size))
    assert tables.shape[1] % (128 // page_size) == 0
    assert torch.equal(tables[:, : batch.block_tables.shape[1]], batch.block_tables)
    assert not tables[:, batch.block_tables.shape[1] :].any()  # pad columns: dummy page 0
    assert kw["seq_lens"].dtype == torch.int32
    assert kw["seq_lens"].tolist() == [10 + q_len, q_len, 130 + q_len, 63 + q_len]
    assert type(kw["max_seq_len"]) is int and kw["max_seq_len"] == MAX_MODEL_LEN
    assert type(kw["bmm1_scale"]) is float and type(kw["bmm2_scale"]) is float  # static
    assert kw["backend"] == "trtllm-gen"
    # flashinfer's own CPU-side validators, as the dispatcher runs them (the aligned-table form
    # that "auto" / cute-dsl require, stricter than trtllm-gen's).
    kv4 = _check_trtllm_gen_mla_shape(
        query, kw["kv_cache"], RANK, ROPE, 0, tables, page_size, True,
        require_aligned_block_table=True,
    )  # fmt: skip
    assert kv4.shape == (batch.kv_pool.num_pages, 1, page_size, RANK + ROPE)
    ws = kw["workspace_buffer"]
    assert ws.dtype == torch.uint8 and ws.dim() == 1 and ws.numel() == WORKSPACE_BYTES
    assert not ws.any()  # zero-initialised: it holds semaphores
    _check_workspace_buffer_alignment(ws, "workspace_buffer")
    counter = kw["multi_ctas_kv_counter_buffer"]
    for bs in range(1, 9):  # every batch size up to max_num_seqs
        _resolve_trtllm_gen_multi_ctas_kv_counter_buffer(counter, bs, HEADS, B200.num_sms, CPU)
    assert not counter.any()
    # Semantics, as for tokenspeed (bmm1 = scale * k_scale, bmm2 = k_scale).
    got = decode_by_semantics(kw, "bmm1_scale", "bmm2_scale")
    q_kernel = e4m3(q).float() if kv_dtype == torch.float8_e4m3fn else q.bfloat16().float()
    ref = reference_decode(problem, q_kernel)
    assert rel_err(got.reshape(ref.shape), ref) < 1e-5


def test_trtllm_uses_the_runner_table_when_aligned() -> None:
    """Width already a multiple of 128 / page_size: no copy, the runner's rows as they are."""
    backend = TrtllmBackend(deepseek_config(), 64, torch.float8_e4m3fn, CPU, 8, 1024, target=B200)
    problem = make_problem(backend, [3, 70], [1, 1], 64, torch.float8_e4m3fn)
    batch = dataclasses.replace(problem.batch, block_tables=torch.zeros(2, 16, dtype=torch.int32))
    backend.prepare(batch)
    assert batch.attn_metadata.block_tables is batch.block_tables


def test_trtllm_counter_and_workspace_are_allocated_once() -> None:
    backend = trtllm()
    need = get_trtllm_gen_multi_ctas_kv_counter_bytes(8, HEADS, B200.num_sms)
    assert backend.kv_counter.numel() >= need and backend.kv_counter.dtype == torch.uint8
    problem = make_problem(backend, [3, 4], [1, 1], 64, torch.float8_e4m3fn)
    ptrs = (backend.workspace.data_ptr(), backend.kv_counter.data_ptr())
    for _ in range(2):
        backend.prepare(problem.batch)
        kw = backend.decode_kwargs(0, torch.zeros(2, HEADS, RANK), torch.zeros(2, HEADS, ROPE),
                                   problem.batch)  # fmt: skip
        assert ptrs == (
            kw["workspace_buffer"].data_ptr(),
            kw["multi_ctas_kv_counter_buffer"].data_ptr(),
        )


# --------------------------------------------------------------------------------------------
# trtllm: prefill (MHA form)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_dtype", "bound"),
    [(torch.bfloat16, 1e-2), (torch.float8_e4m3fn, 6e-2)],  # measured 2.4e-3, 4.5e-2
)
def test_trtllm_prefill_arguments(kv_dtype: torch.dtype, bound: float) -> None:
    backend = trtllm(kv_dtype=kv_dtype)
    problem = make_problem(backend, PREFIX, Q_LENS, 64, kv_dtype)
    batch = problem.batch
    before = batch.kv_pool.kv_buffers[0].view(torch.uint8).clone()
    backend.prepare(batch)
    q, w_uk, w_uv = extend_inputs(problem)
    rows = problem.new_rows
    kw = backend.prefill_kwargs(0, q, rows[:, :RANK], rows[:, RANK:], w_uk, w_uv, batch)
    bound_args = bind(trtllm_ragged_attention_deepseek, kw)
    assert bound_args.arguments["q_seq_lens_cpu"] is None  # no host validation pass

    t, s = sum(Q_LENS), sum(p + n for p, n in zip(PREFIX, Q_LENS))
    # The kernel's DeepSeek-R1 head dims (its "is_dsr1" check): 192 / 192 / 128.
    shapes = {"query": (t, HEADS, 192), "key": (s, HEADS, 192), "value": (s, HEADS, 128)}
    for name, shape in shapes.items():
        assert kw[name].shape == shape and kw[name].dtype == kv_dtype
        assert kw[name].is_contiguous()
    assert kw["cum_seq_lens_kv"].tolist() == [0, 37, 127, 133]
    assert kw["cum_seq_lens_q"].tolist() == [0, 37, 57, 58]
    for name in ("cum_seq_lens_kv", "cum_seq_lens_q", "seq_lens"):
        assert kw[name].dtype == torch.int32
    assert kw["seq_lens"].tolist() == [37, 90, 6]
    assert (kw["max_q_len"], kw["max_kv_len"], kw["batch_size"]) == (37, 90, 3)
    assert type(kw["bmm1_scale"]) is float and type(kw["bmm2_scale"]) is float
    assert kw["is_causal"] is True and kw["backend"] == "trtllm-gen"
    assert kw["workspace_buffer"] is backend.workspace
    got = causal_varlen_attention(
        kw["query"].float(), kw["key"].float(), kw["value"].float(), batch.attn_metadata,
        kw["bmm1_scale"],
    )  # fmt: skip
    ref = reference_extend(problem, q, w_uk, w_uv, before)
    assert rel_err(got, ref) < bound


# --------------------------------------------------------------------------------------------
# constraints, choice, cubins
# --------------------------------------------------------------------------------------------

SM90, SM107, SM120 = GpuTarget((9, 0), 132), GpuTarget((10, 7), 160), GpuTarget((12, 0), 84)
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@pytest.mark.parametrize(
    ("cls", "page_size", "kv_dtype", "target", "config", "match"),
    [
        (TokenspeedBackend, 64, BF16, B200, {}, "fp8_e4m3"),
        (TokenspeedBackend, 16, FP8, B200, {}, "page_size"),
        (TokenspeedBackend, 128, FP8, B200, {}, "page_size"),
        (TokenspeedBackend, 64, FP8, SM90, {}, "SM90"),
        (TokenspeedBackend, 64, FP8, SM120, {}, "SM120"),
        (TokenspeedBackend, 64, FP8, B200, {"rank": 256}, "512/64"),
        (TokenspeedBackend, 64, FP8, B200, {"heads": 256}, "num_attention_heads"),
        (TrtllmBackend, 16, FP8, B200, {}, "page_size"),
        (TrtllmBackend, 64, torch.float32, B200, {}, "kv_cache_dtype"),
        (TrtllmBackend, 64, FP8, SM107, {}, "SM107"),
        (TrtllmBackend, 64, FP8, SM90, {}, "SM90"),
        (TrtllmBackend, 64, FP8, B200, {"rope": 32}, "512/64"),
        (TrtllmBackend, 64, FP8, B200, {"heads": 96}, "num_attention_heads"),
    ],
)
def test_constraint_errors(cls, page_size, kv_dtype, target, config, match) -> None:
    mc = deepseek_config(**config)
    with pytest.raises(BackendUnsupportedError, match=match):
        cls.check_target(mc, page_size, kv_dtype, target)
    with pytest.raises(BackendUnsupportedError, match=match):  # construction checks too
        cls(mc, page_size, kv_dtype, CPU, 4, 256, target=target)


@pytest.mark.parametrize("cls", [TokenspeedBackend, TrtllmBackend])
def test_needs_cuda_and_bounded_q_len(cls) -> None:
    with pytest.raises(BackendUnsupportedError, match="CUDA"):
        cls.check_supported(deepseek_config(), 64, FP8, CPU)
    cls.check_target(deepseek_config(heads=128), 64, FP8, B200)  # DeepSeek-V3 at TP1: fine
    too_long = cls.max_uniform_q_len + 1
    with pytest.raises(BackendUnsupportedError, match="max_q_len"):
        cls(deepseek_config(), 64, FP8, CPU, 4, 256, max_q_len=too_long, target=B200)


@pytest.mark.parametrize(
    ("target", "kv_dtype", "expected"),
    [
        (B200, FP8, "trtllm"),  # small-batch TPOT: trtllm-gen before tokenspeed
        (B200, BF16, "trtllm"),  # tokenspeed is fp8-only
        (GpuTarget((10, 3), 148), FP8, "trtllm"),
        (SM107, FP8, "tokenspeed"),  # no trtllm-gen cubins for SM107
        (SM107, BF16, "reference"),
        (SM120, FP8, "reference"),
    ],
)
def test_auto_choice_by_capability_and_kv_dtype(target, kv_dtype, expected, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="mlaserve.kernels_adapter.registry"):
        got = resolve_backend_name("auto", deepseek_config(), 64, kv_dtype, CPU, target=target)
    assert got == expected
    assert f"attention_backend auto -> {expected}" in caplog.text and target.sm_name in caplog.text
    # pure torch on a GPU is a warning (several times slower decode), a kernel backend info
    (record,) = [r for r in caplog.records if "attention_backend auto" in r.getMessage()]
    assert record.levelno == (logging.WARNING if expected == "reference" else logging.INFO)


def test_missing_cubins_are_reported_before_the_first_request(tmp_path) -> None:
    from flashinfer.artifacts import ArtifactPath

    problem = missing_cubins(tmp_path)
    assert (
        problem is not None and "flashinfer-cubin" in problem and "FLASHINFER_CUBIN_DIR" in problem
    )
    fmha = tmp_path / ArtifactPath.TRTLLM_GEN_FMHA
    fmha.mkdir(parents=True)
    (fmha / "checksums.txt").write_text("0" * 64 + " some.cubin\n")
    assert "not the manifest flashinfer pins" in missing_cubins(tmp_path)


def test_adapters_bind_the_functions_the_tests_check() -> None:
    """The objects the adapters call are the ones whose signatures are checked above."""
    assert trtllm()._decode is trtllm_batch_decode_with_kv_cache_mla
    assert trtllm()._prefill is trtllm_ragged_attention_deepseek
    assert tokenspeed()._ts.tokenspeed_mla_decode is tokenspeed_mla_decode
    assert tokenspeed()._ts.tokenspeed_mla_prefill is tokenspeed_mla_prefill


# --------------------------------------------------------------------------------------------
# per-rank heads (tensor parallelism): DeepSeek-V3's 128 heads at TP 1 / 2 / 4 / 8
# --------------------------------------------------------------------------------------------

V3_HEADS = 128
TP_HEADS = [(1, 128), (2, 64), (4, 32), (8, 16)]


def v3_rank(cls, heads: int, max_q_len: int, kv_dtype=FP8, target=B200, page_size=64):
    """The backend one rank of DeepSeek-V3 (128 heads) builds: `heads` of them."""
    return cls(
        deepseek_config(heads=V3_HEADS), page_size, kv_dtype, CPU, 8, MAX_MODEL_LEN,
        max_q_len=max_q_len, num_heads=heads, target=target,
    )  # fmt: skip


def decode_case(backend, q_len: int, kv_dtype):
    """A 4-sequence uniform batch of `q_len` over cached prefixes, the new KV written, and the
    adapter's kwargs for a random query of the backend's heads a rank."""
    problem = make_problem(backend, [10, 0, 130, 63], [q_len] * 4, backend.page_size, kv_dtype)
    batch = problem.batch
    backend.prepare(batch)
    rows = problem.new_rows
    batch.kv_pool.write(0, batch.slot_mapping, rows[:, :RANK], rows[:, RANK:])
    q = torch.randn(batch.num_tokens, backend.num_heads, RANK + ROPE)
    return problem, q, backend.decode_kwargs(0, q[..., :RANK], q[..., RANK:], batch)


@pytest.mark.parametrize(("tp", "heads"), TP_HEADS)
def test_tokenspeed_per_rank_heads(tp: int, heads: int) -> None:
    """Buffers sized for the rank's heads, the query shaped with them, the package's own checks
    for them, and the kernel's semantics on the rank's heads reproduce the reference."""
    max_q_len = TokenspeedBackend.max_q_len_for(heads)
    assert max_q_len == (8 if heads == 16 else 4)
    backend = v3_rank(TokenspeedBackend, heads, max_q_len)
    assert backend.num_heads == heads == V3_HEADS // tp
    assert backend.workspace.numel() == workspace_bytes(B200.num_sms, heads, max_q_len, RANK)
    for q_len in range(1, max_q_len + 1):
        ts_decode_module._check_can_implement(
            FP8, 64, heads, q_len, RANK, ROPE, False, True, False, B200.capability
        )
        for bs in (1, 4, 8):
            need = tokenspeed_package_workspace(bs, q_len, heads, B200, MAX_MODEL_LEN)
            assert need <= backend.workspace.numel(), (bs, q_len, need)
    problem, q, kw = decode_case(backend, max_q_len, FP8)
    bind(tokenspeed_mla_decode, kw)
    assert kw["query"].shape == (4, max_q_len, heads, RANK + ROPE)
    assert kw["query"].stride(1) == heads * kw["query"].stride(2)  # packable rows
    got = decode_by_semantics(kw, "softmax_scale", "output_scale")
    ref = reference_decode(problem, e4m3(q).float())
    assert ref.shape == (4 * max_q_len, heads, RANK)
    assert rel_err(got.reshape(ref.shape), ref) < 1e-5


@pytest.mark.parametrize("target", [B200, GpuTarget((10, 3), 148), SM107], ids=str)
def test_tokenspeed_heads_times_q_len(target: GpuTarget) -> None:
    """tokenspeed_mla 2.0.4: H <= 128 a rank (`can_implement`), q_len <= 4 documented at any such
    H; a longer q_len only where H * q_len <= 128, where the package folds every query token
    into one MMA tile (fold factor = q_len, one q tile: its q_len-1 shape). V3 at TP8 (16 heads)
    verifies k = 3..7 draft tokens (q_len 4..8); at TP1 (128 heads) q_len <= 4 only."""
    v3 = deepseek_config(heads=V3_HEADS)
    for heads, q_len in [(16, 4), (16, 5), (16, 8), (32, 4), (128, 1), (128, 4)]:
        TokenspeedBackend.check_target(v3, 64, FP8, target, num_heads=heads, max_q_len=q_len)
        ts_decode_module._check_can_implement(
            FP8, 64, heads, q_len, RANK, ROPE, False, True, False, target.capability
        )
        if q_len > 4:  # accepted beyond the documented range: folded into one tile
            assert heads * q_len <= 128
            tiler, _ = select_mla_decode_tilers(
                heads, q_len, is_fp8=True, compute_capability=target.capability
            )
            assert get_mla_decode_fold_sq_factor(heads, q_len, tiler[0]) == q_len
    v3_rank(TokenspeedBackend, 16, 8, target=target)  # TP8, k = 7: builds
    for heads, q_len in [(128, 5), (128, 8), (64, 5), (32, 5), (16, 9)]:
        with pytest.raises(BackendUnsupportedError, match=rf"{heads} heads a rank.*heads x q_len"):
            TokenspeedBackend.check_target(v3, 64, FP8, target, num_heads=heads, max_q_len=q_len)
        with pytest.raises(BackendUnsupportedError, match="max_q_len"):
            v3_rank(TokenspeedBackend, heads, q_len, target=target)


@pytest.mark.parametrize(("tp", "heads"), TP_HEADS)
@pytest.mark.parametrize("kv_dtype", [FP8, BF16], ids=str)
def test_trtllm_per_rank_heads(tp: int, heads: int, kv_dtype: torch.dtype) -> None:
    """trtllm-gen takes H <= 64 or H == 128 a rank: every TP of V3. Its multi-CTA counter is
    sized for the rank's heads (flashinfer's own size and resolver), the query shaped with them
    passes flashinfer's validator, and the semantics reproduce the reference."""
    backend = v3_rank(TrtllmBackend, heads, 8, kv_dtype=kv_dtype)
    assert backend.num_heads == heads == V3_HEADS // tp
    need = get_trtllm_gen_multi_ctas_kv_counter_bytes(8, heads, B200.num_sms)
    assert backend.kv_counter.numel() == need
    for bs in range(1, 9):
        _resolve_trtllm_gen_multi_ctas_kv_counter_buffer(
            backend.kv_counter, bs, heads, B200.num_sms, CPU
        )
    problem, q, kw = decode_case(backend, 4, kv_dtype)
    bind(trtllm_batch_decode_with_kv_cache_mla, kw)
    assert kw["query"].shape == (4, 4, heads, RANK + ROPE)
    _check_trtllm_gen_mla_shape(
        kw["query"], kw["kv_cache"], RANK, ROPE, 0, kw["block_tables"], 64, True,
        require_aligned_block_table=True,
    )  # fmt: skip
    got = decode_by_semantics(kw, "bmm1_scale", "bmm2_scale")
    q_kernel = e4m3(q).float() if kv_dtype == FP8 else q.bfloat16().float()
    ref = reference_decode(problem, q_kernel)
    assert rel_err(got.reshape(ref.shape), ref) < 1e-5


@pytest.mark.parametrize("cls", [TokenspeedBackend, TrtllmBackend])
def test_prefill_per_rank_heads(cls) -> None:
    """The MHA-form prefill at TP8 (16 of V3's 128 heads): Q / K / V carry the rank's heads."""
    backend = v3_rank(cls, 16, 4)
    problem = make_problem(backend, PREFIX, Q_LENS, 64, FP8)
    backend.prepare(problem.batch)
    q, w_uk, w_uv = extend_inputs(problem)
    rows = problem.new_rows
    kw = backend.prefill_kwargs(0, q, rows[:, :RANK], rows[:, RANK:], w_uk, w_uv, problem.batch)
    t, s = sum(Q_LENS), sum(p + n for p, n in zip(PREFIX, Q_LENS))
    assert kw["query"].shape == (t, 16, 192)
    assert kw["key"].shape == (s, 16, 192) and kw["value"].shape == (s, 16, 128)
    with pytest.raises(ValueError, match=r"w_uk .* must have 16 heads"):
        backend.prefill_kwargs(
            0, q, rows[:, :RANK], rows[:, RANK:], torch.cat([w_uk, w_uk]), w_uv, problem.batch
        )


@pytest.mark.parametrize("cls", [TokenspeedBackend, TrtllmBackend])
def test_query_of_another_head_count_is_refused(cls) -> None:
    """Built for 16 heads a rank, a 128-head query is an error, not a silent reshape."""
    backend = v3_rank(cls, 16, 1)
    problem = make_problem(backend, [3, 4], [1, 1], 64, FP8)
    backend.prepare(problem.batch)
    q = torch.zeros(2, V3_HEADS, RANK + ROPE)
    with pytest.raises(ValueError, match="must have 16 heads on dim 1"):
        backend.decode_kwargs(0, q[..., :RANK], q[..., RANK:], problem.batch)


def test_per_rank_head_limits() -> None:
    """Per-rank counts against each kernel's head limit, with the model's count in the error."""
    big = deepseek_config(heads=192)  # 192 heads: TP2 -> 96 a rank, TP4 -> 48
    with pytest.raises(BackendUnsupportedError, match=r"heads per rank .*192.* <= 64 or .* 96"):
        TrtllmBackend.check_target(big, 64, FP8, B200, num_heads=96)
    TrtllmBackend.check_target(big, 64, FP8, B200, num_heads=48)
    with pytest.raises(BackendUnsupportedError, match=r"heads per rank .*256.* <= 128, got 256"):
        TokenspeedBackend.check_target(deepseek_config(heads=256), 64, FP8, B200)
    TokenspeedBackend.check_target(deepseek_config(heads=256), 64, FP8, B200, num_heads=128)
    for cls in (TokenspeedBackend, TrtllmBackend):
        with pytest.raises(ValueError, match="num_heads"):
            cls.check_target(deepseek_config(heads=V3_HEADS), 64, FP8, B200, num_heads=24)


@pytest.mark.parametrize(
    ("target", "heads", "max_q_len", "expected"),
    [
        (SM107, 128, 1, "tokenspeed"),  # V3 TP1 decode
        (SM107, 128, 4, "tokenspeed"),  # TP1, k = 3: the package's documented q_len <= 4
        (SM107, 128, 8, "reference"),  # TP1, k = 7: 128 x 8 > 128
        (SM107, 16, 8, "tokenspeed"),  # TP8, k = 7: 16 x 8 = 128
        (SM107, 32, 8, "reference"),  # TP4, k = 7: 32 x 8 > 128
        (B200, 16, 8, "trtllm"),
        (B200, 128, 8, "trtllm"),
    ],
)
def test_auto_choice_per_rank(target, heads, max_q_len, expected) -> None:
    v3 = deepseek_config(heads=V3_HEADS)
    got = resolve_backend_name(
        "auto", v3, 64, FP8, CPU, num_heads=heads, max_q_len=max_q_len, target=target
    )
    assert got == expected


def test_named_backend_refuses_the_per_rank_shape_and_make_backend_builds_it() -> None:
    v3 = deepseek_config(heads=V3_HEADS)
    with pytest.raises(BackendUnsupportedError, match="128 heads a rank, got 8"):
        resolve_backend_name(
            "tokenspeed", v3, 64, FP8, CPU, num_heads=128, max_q_len=8, target=SM107
        )
    from mlaserve.kernels_adapter import make_backend

    backend = make_backend(
        "auto", v3, 64, FP8, CPU, 8, MAX_MODEL_LEN, max_q_len=8, num_heads=16, target=SM107
    )
    assert isinstance(backend, TokenspeedBackend) and backend.num_heads == 16
    assert backend.workspace.numel() == workspace_bytes(SM107.num_sms, 16, 8, RANK)
