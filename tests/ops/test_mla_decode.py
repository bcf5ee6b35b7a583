"""MLA decode attention (`ops/mla_decode.py`) vs a pure-torch fp32 reference over the paged cache.

The cache is NaN-poisoned: every byte of the pool starts as 0xFF (NaN in e4m3, bf16, fp16 and
fp32), then only each sequence's tokens 0 .. L - 1 are written, so a read of an unused page, an
unused row of a used page, or a page-table entry past the sequence (those point at NaN pages)
turns the output NaN. Page tables are shuffled, non-contiguous page lists. q_nope and q_pe are
views into NaN-filled wider rows (q_pe as in the model: the tail of each head's q projection),
`out` a view into NaN rows whose columns and rows past the output must stay NaN.

Batches are ragged: lengths below one key block (32) or one page (64), exact multiples of both,
L = q_len (L = 1 at q_len 1), many pages, up to 8192 on the GPU, and padded rows as graphs pad them
(seq_len = q_len, page-table row of zeros, page 0's first q_len rows written as the padded
tokens' KV would be); these must come out finite. At q_len > 1 each batch holds a short
sequence for which dropping the causal mask among the new tokens would move the output by more
than 10x the tolerance (asserted), so a wrong mask fails.

Tolerance: |got - ref| <= atol + rtol * |ref| with (atol, rtol) = (1e-2, 1e-2) for bf16 q (the
kernel rounds the probabilities to q's dtype for P @ V and the output once), (2e-3, 2e-3) for
fp16 q and (1e-4, 1e-4) for fp32 q (the CPU cases, under Triton's interpreter, at tiny shapes:
r 64, d_r 16, page 16).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.ops.cases import cpu_case, gpu, gpu_case, model_dtype

FP8, BF16, F16 = torch.float8_e4m3fn, torch.bfloat16, torch.float16
PAD = None  # a padded row of a CUDA-graph batch
K_SCALE = 0.5  # the fp8 cache's scale (value = stored * k_scale)

# device: (kv_lora_rank, rope dim, page size)
DIMS = {"cuda": (512, 64, 64), "cpu": (64, 16, 16)}


def _lengths(bs: int, q_len: int, device: str) -> list[int | None]:
    if device == "cuda":
        table = {
            1: [4096 + 7],
            3: [q_len + 5, 128, 8192],
            8: [q_len, 37, 64, 65, 640, 1000 + q_len, 8192, PAD],
        }
    else:
        table = {1: [150], 3: [q_len + 3, 64, 203], 8: [q_len, 5, 16, 64, 65, 100, 130, PAD]}
    return table[bs]


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    return {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3)}.get(dtype, (1e-2, 1e-2))


def _batch(lengths, q_len, heads, kv_dtype, device, *, seed=0, num_pages=None, max_pages=None,
           q_dtype=None):  # fmt: skip
    """Inputs of one call: q views, a NaN-poisoned cache with only the valid tokens written,
    shuffled page tables. -> dict"""
    rank, rope, page = DIMS[device]
    dtype = q_dtype or model_dtype(device)
    g = torch.Generator().manual_seed(seed)
    bs = len(lengths)
    seq_lens = [q_len if n is PAD else n for n in lengths]
    need = [0 if n is PAD else -(-n // page) for n in lengths]
    num_pages = num_pages or 1 + sum(need) + 4
    max_pages = max_pages or max(need) + 2
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    spare = perm[sum(need) :]  # never written: all NaN
    cache = torch.empty(num_pages, page, rank + rope, dtype=kv_dtype)
    cache.view(torch.uint8).fill_(0xFF)
    tables = spare[torch.randint(len(spare), (bs, max_pages), generator=g)].to(torch.int32)
    scale = K_SCALE if kv_dtype == FP8 else 1.0

    def write(pages: torch.Tensor, n: int) -> None:
        rows = torch.randn(n, rank + rope, generator=g) / scale  # dequantised: N(0, 1)
        idx = torch.arange(n)
        stored = rows.to(kv_dtype).view(torch.uint8)  # index_put has no float8 kernel
        cache.view(torch.uint8)[pages[idx // page].long(), idx % page] = stored

    used = 0
    for b, n in enumerate(lengths):
        if n is PAD:
            tables[b] = 0
            continue
        tables[b, : need[b]] = perm[used : used + need[b]].to(torch.int32)
        used += need[b]
        write(tables[b], n)
    if PAD in lengths:  # the padded tokens' KV, written at page 0 (as the engine pads slots)
        write(torch.zeros(1, dtype=torch.int32), q_len)

    t = bs * q_len
    qp_rows = torch.full((t, heads, 128 + rope), float("nan"))
    q_pe = qp_rows[:, :, 128:]  # the rope tail of each head's q projection row
    q_pe.copy_(torch.randn(t, heads, rope, generator=g))
    qn_rows = torch.full((t, heads, rank + 32), float("nan"))
    q_nope = qn_rows[:, :, :rank]
    q_nope.copy_(torch.randn(t, heads, rank, generator=g))
    out_rows = torch.full((t + 1, heads, rank + 16), float("nan"))
    return {
        "q_nope": q_nope.to(device, dtype),
        "q_pe": qp_rows.to(device, dtype)[:, :, 128:],
        "kv_cache": cache.to(device),
        "k_scale": torch.full((1,), scale, device=device),
        "block_tables": tables.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "q_len": q_len,
        "softmax_scale": 1.0 / math.sqrt(128 + rope),
        "out_rows": out_rows.to(device, dtype),
    }


def _reference(q_nope, q_pe, kv_cache, k_scale, block_tables, seq_lens, q_len, softmax_scale,
               causal=True) -> torch.Tensor:  # fmt: skip
    """fp32: each sequence's keys 0 .. L - 1 gathered through its page table, softmax, @ c_kv."""
    num_tokens, heads, rank = q_nope.shape
    page = kv_cache.shape[1]
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    scale = float(k_scale) if kv_cache.dtype == FP8 else 1.0
    out = torch.zeros(num_tokens, heads, rank, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        idx = torch.arange(n, device=q.device)
        pages = block_tables[b, idx // page].long()
        if kv_cache.element_size() == 1:  # fp8: gather bytes (no float8 indexing kernels needed)
            kv = kv_cache.view(torch.uint8)[pages, idx % page].view(kv_cache.dtype)
        else:
            kv = kv_cache[pages, idx % page]
        kv = kv.float() * scale  # [n, D]
        rows = slice(b * q_len, (b + 1) * q_len)
        s = torch.einsum("ihd,nd->ihn", q[rows], kv) * softmax_scale
        if causal:  # row i sees keys 0 .. n - q_len + i
            last = n - q_len + torch.arange(q_len, device=q.device)
            s = s.masked_fill(idx[None, None, :] > last[:, None, None], float("-inf"))
        out[rows] = torch.softmax(s, dim=-1) @ kv[:, :rank]
    return out


def _call(batch, **kwargs) -> torch.Tensor:
    from mlaserve.ops.mla_decode import mla_decode

    args = {k: v for k, v in batch.items() if k != "out_rows"}
    return mla_decode(**args, **kwargs)


def _check(batch, got, lengths):
    ref = _reference(**{k: v for k, v in batch.items() if k != "out_rows"})
    atol, rtol = _tol(got.dtype)
    err = (got.float() - ref).abs()
    bad = ~(err <= atol + rtol * ref.abs())  # NaN counts as bad
    assert not bad.any(), f"{int(bad.sum())} bad, max err {err.max()} (NaN: {got.isnan().any()})"
    q_len = batch["q_len"]
    for b, n in enumerate(lengths):
        if n is PAD:
            assert torch.isfinite(got[b * q_len : (b + 1) * q_len]).all()
    if q_len > 1 and min(n or 1 << 30 for n in lengths) <= 16:  # the causal mask matters
        args = {k: v for k, v in batch.items() if k != "out_rows"}
        moved = (_reference(**args, causal=False) - ref).abs().max()
        assert moved > 10 * (atol + rtol), f"the causal mask moves the output by only {moved}"


GPU_CASES = [
    gpu_case(kv, q_len, bs, 16) for kv in (FP8, BF16) for q_len in (1, 2, 4) for bs in (1, 3, 8)
] + [gpu_case(kv, q_len, bs, h) for kv in (FP8, BF16) for q_len in (1, 2) for bs in (1, 3)
     for h in (128, 20)]  # fmt: skip
CPU_CASES = [
    cpu_case(F16, 1, 1, 3),
    cpu_case(FP8, 2, 3, 3),
    cpu_case(F16, 4, 3, 3),
    cpu_case(FP8, 1, 8, 3),
    cpu_case(F16, 2, 8, 3),
    cpu_case(FP8, 4, 1, 3),
    cpu_case(F16, 2, 3, 20),  # 40 query rows: three head groups of 16, the last ragged
]


@pytest.mark.parametrize(("kv_dtype", "q_len", "bs", "heads", "device"), GPU_CASES + CPU_CASES)
def test_mla_decode_matches_reference(kv_dtype, q_len, bs, heads, device):
    from mlaserve.ops.mla_decode import MlaDecodeWorkspace

    lengths = _lengths(bs, q_len, device)
    batch = _batch(lengths, q_len, heads, kv_dtype, device, seed=bs * 10 + q_len)
    rank = DIMS[device][0]
    out_rows = batch["out_rows"]
    out = out_rows[: bs * q_len, :, :rank]
    ws = MlaDecodeWorkspace(bs, q_len, heads, rank, device)
    got = _call(batch, workspace=ws, out=out)
    assert got.data_ptr() == out.data_ptr()
    _check(batch, got, lengths)
    assert out_rows[bs * q_len :].isnan().all() and out_rows[:, :, rank:].isnan().all()
    fresh = _call(batch)  # no workspace: allocated per call, the same splits and bits
    assert torch.equal(fresh, got)


# (kv dtype, q_len, lengths, num_splits or config): the direct path (1 split), more splits than
# keys, and a small config (16-key blocks, chunks of >= 2 blocks, scores in 16-wide slices of r;
# r is 64 here, a single slice with the default block_d).
SPLIT_CASES = [
    cpu_case(F16, 2, (65, 2, 130), "splits=1"),
    cpu_case(FP8, 2, (65, 2, 130), "splits=64"),
    cpu_case(F16, 3, (3, 17, 33, 64, 100), "small"),
    cpu_case(F16, 1, (1, 150), "splits=3"),
    cpu_case(torch.float32, 2, (5, 70), "fp32"),  # fp32 q and cache: exact products ("ieee")
]


@pytest.mark.parametrize(("kv_dtype", "q_len", "lengths", "variant", "device"), SPLIT_CASES)
def test_split_variants_match_reference(kv_dtype, q_len, lengths, variant, device):
    from mlaserve.ops.mla_decode import MlaDecodeConfig

    q_dtype = torch.float32 if variant == "fp32" else None
    batch = _batch(list(lengths), q_len, 6, kv_dtype, device, seed=len(lengths), q_dtype=q_dtype)
    if variant == "small":
        cfg = MlaDecodeConfig(block_n=16, block_d=16, min_chunk_blocks=2)
        kwargs = {"config": cfg}
    elif variant == "fp32":
        kwargs = {}
    else:
        kwargs = {"num_splits": int(variant.split("=")[1])}
    _check(batch, _call(batch, **kwargs), list(lengths))


@pytest.mark.parametrize("device", [cpu_case()])
def test_small_workspace_lowers_splits(device):
    """A workspace sized for smaller batches holds fewer splits: still the right answer."""
    from mlaserve.ops.mla_decode import MlaDecodeWorkspace, choose_num_splits

    lengths = [203]
    batch = _batch(lengths, 2, 3, F16, device, seed=7)
    # sized for q_len 1: 3 heads x 8 splits (the interpreter's 4 "SMs") = 24 rows; this call
    # wants 2 x 3 x 8 = 48 and gets 4 splits
    small = MlaDecodeWorkspace(1, 1, 3, DIMS[device][0], device)
    assert small.rows == 24 and choose_num_splits(1, 2, 3, small.num_sms) == 8
    _check(batch, _call(batch, workspace=small), lengths)


def test_choose_num_splits_and_workspace_rows():
    from mlaserve.ops.mla_decode import (
        MlaDecodeConfig,
        choose_num_splits,
        head_groups,
        mla_decode_workspace_rows,
    )

    assert head_groups(1, 16) == 1  # V2-Lite decode: 16 rows, one BLOCK_M of 16
    assert head_groups(4, 16) == 4  # 64 rows in 16-row groups
    assert head_groups(1, 128) == 8  # V3
    assert head_groups(3, 5) == 1
    assert head_groups(4, 16, MlaDecodeConfig(max_block_m=64)) == 1
    assert choose_num_splits(1, 1, 16, 132) == 64  # capped at max_splits
    assert choose_num_splits(8, 1, 16, 132) == 33  # ceil(264 / 8)
    assert choose_num_splits(32, 4, 16, 132) == 3  # 128 programs: ceil(264 / 128)
    assert choose_num_splits(264, 1, 16, 132) == 1
    assert choose_num_splits(1, 1, 16, 132, MlaDecodeConfig(max_splits=8)) == 8
    assert choose_num_splits(8, 1, 16, 132, MlaDecodeConfig(programs_per_sm=1)) == 17
    for bs in range(1, 300):
        for q_len in (1, 2, 4, 8):
            for heads in (16, 128):
                s = choose_num_splits(bs, q_len, heads, 132)
                programs = bs * head_groups(q_len, heads)
                assert 1 <= s <= 64
                assert s == 64 or programs * s >= 2 * 132  # two programs per SM
                assert s == 1 or programs * (s - 1) < 2 * 132  # no more than needed
    rows = mla_decode_workspace_rows(8, 2, 16, 132)
    assert rows == max(
        bs * q * 16 * choose_num_splits(bs, q, 16, 132) for bs in range(1, 9) for q in (1, 2)
    )
    # T * H <= programs * 16 rows and programs * splits < 2 * 132 + programs < 4 * 132
    for heads in (16, 128):
        assert 0 < mla_decode_workspace_rows(300, 8, heads, 132) < 16 * 4 * 132
    assert mla_decode_workspace_rows(4, 1, 16, 1, MlaDecodeConfig(max_splits=1)) == 0


def test_block_n_by_query_rows():
    """Calls of >= wide_min_rows query rows (bs * q_len * H) take the wide key step: V3's heads
    a rank at every batch, 16 heads from two tokens; a one-token 16-head call keeps block_n."""
    from mlaserve.ops.mla_decode import MlaDecodeConfig, block_n_for

    cfg = MlaDecodeConfig()
    assert block_n_for(1 * 1 * 16) == cfg.block_n == 16  # V2-Lite, V3 at TP8: bs 1
    assert block_n_for(2 * 1 * 16) == cfg.wide_block_n == 32  # bs 2, or q_len 2
    assert block_n_for(1 * 1 * 64) == 32  # V3 at TP2
    assert block_n_for(31, MlaDecodeConfig(wide_min_rows=32)) == 16
    assert block_n_for(64, MlaDecodeConfig(wide_block_n=64)) == 64
    with pytest.raises(ValueError, match="wide_block_n"):
        MlaDecodeConfig(wide_block_n=24)
    with pytest.raises(ValueError, match="wide_min_rows"):
        MlaDecodeConfig(wide_min_rows=0)


def test_rejects_what_does_not_fit():
    from mlaserve.ops.mla_decode import mla_decode

    q = torch.zeros(4, 2, 64, dtype=F16)
    qp = torch.zeros(4, 2, 16, dtype=F16)
    kv = torch.zeros(3, 16, 80, dtype=F16)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    sl = torch.full((2,), 2, dtype=torch.int32)
    ks = torch.ones(1)

    def call(**kw):
        args = {"q_nope": q, "q_pe": qp, "kv_cache": kv, "k_scale": ks, "block_tables": bt,
                "seq_lens": sl, "q_len": 2, "softmax_scale": 0.1} | kw  # fmt: skip
        return mla_decode(**args)

    with pytest.raises(ValueError, match="do not fit"):
        call(kv_cache=torch.zeros(3, 16, 81, dtype=F16))
    with pytest.raises(ValueError, match="multiples of 16"):
        call(q_nope=torch.zeros(4, 2, 56, dtype=F16), kv_cache=torch.zeros(3, 16, 72, dtype=F16))
    with pytest.raises(ValueError, match="one of bf16"):
        call(q_pe=qp.float())
    with pytest.raises(ValueError, match="kv_cache dtype"):
        call(kv_cache=kv.to(torch.int8))
    with pytest.raises(ValueError, match="contiguous last dim"):
        call(q_nope=q.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="not bs x q_len"):
        call(q_len=3)
    with pytest.raises(ValueError, match="not bs x q_len"):
        q17, qp17 = torch.zeros(17, 2, 64, dtype=F16), torch.zeros(17, 2, 16, dtype=F16)
        call(q_len=17, q_nope=q17, q_pe=qp17)
    with pytest.raises(ValueError, match="seq_lens"):
        call(seq_lens=sl.long())
    with pytest.raises(ValueError, match="block_tables"):
        call(block_tables=bt[:1])
    with pytest.raises(ValueError, match="k_scale"):
        call(kv_cache=kv.to(FP8), k_scale=None)
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.zeros(4, 2, 63, dtype=F16))


def _chain_inputs(device, kv_dtype, seed):
    """One decode step's inputs at bs 4, q_len 2 (one padded row), fixed shapes."""
    lengths = {0: [300, 2, 4096 + 3, PAD], 1: [64, 1000, 5, PAD]}[seed]
    return lengths, _batch(lengths, 2, 16, kv_dtype, device, seed=seed, num_pages=90, max_pages=70)


@pytest.mark.parametrize("kv_dtype", [FP8, BF16])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu, id="cuda")])
def test_cuda_graph_replay_matches_eager(kv_dtype, device):
    """A decode step's chain, captured once: write_kv stores the new tokens' KV, head_gemv makes
    q_nope (both PDL kernels, so a read before the wait would race), mla_decode, head_gemv on
    its output. Replayed after seq_lens, page tables, cache and inputs change in place, it
    matches the same chain run eagerly without PDL, bit for bit, and the reference."""
    from mlaserve.ops.head_gemv import head_gemv
    from mlaserve.ops.kv_write import write_kv
    from mlaserve.ops.mla_decode import MlaDecodeWorkspace, mla_decode
    from mlaserve.ops.pdl import pdl_launch

    lengths, live = _chain_inputs(device, kv_dtype, 0)
    heads, (rank, rope, page) = 16, DIMS[device]
    g = torch.Generator(device=device).manual_seed(3)
    w_uk = (torch.randn(heads, 128, rank, device=device, generator=g) / 11).to(BF16)
    w_uv = (torch.randn(heads, rank, 128, device=device, generator=g) / 22).to(BF16)
    x = torch.empty(8, heads, 128, dtype=BF16, device=device)
    kv_new = torch.empty(8, rank + rope, dtype=BF16, device=device)
    slots = torch.empty(8, dtype=torch.int64, device=device)
    ws = MlaDecodeWorkspace(4, 2, heads, rank, device)
    kv_scale = K_SCALE if kv_dtype == FP8 else 1.0

    def refresh(batch, lengths, seed):
        """New step inputs in place: x, the new tokens' KV and their slots (the last q_len
        tokens of each sequence; page 0 for padded rows)."""
        gen = torch.Generator(device=device).manual_seed(seed)
        x.copy_(torch.randn(x.shape, device=device, generator=gen))
        kv_new.copy_(torch.randn(kv_new.shape, device=device, generator=gen))
        for b, n in enumerate(lengths):
            n = n or 2
            for i in range(2):
                pos = n - 2 + i
                slots[b * 2 + i] = int(batch["block_tables"][b, pos // page]) * page + pos % page
        for key in ("kv_cache", "block_tables", "seq_lens", "q_pe"):
            live[key].copy_(batch[key])

    def step():
        write_kv(live["kv_cache"], slots, kv_new[:, :rank], kv_new[:, rank:], kv_scale)
        q_nope = head_gemv(x, w_uk)
        o = mla_decode(
            q_nope, live["q_pe"], live["kv_cache"], live["k_scale"], live["block_tables"],
            live["seq_lens"], 2, live["softmax_scale"], workspace=ws,
        )  # fmt: skip
        return o, head_gemv(o, w_uv)

    refresh(live, lengths, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_o, graph_y = step()

    lengths, fresh = _chain_inputs(device, kv_dtype, 1)
    refresh(fresh, lengths, 1)
    graph.replay()
    torch.cuda.synchronize()
    got_o, got_y = graph_o.clone(), graph_y.clone()

    refresh(fresh, lengths, 1)  # the same cache state again, eager and without PDL
    old = os.environ.get("MLASERVE_PDL")
    os.environ["MLASERVE_PDL"] = "0"
    pdl_launch.cache_clear()
    try:
        want_o, want_y = step()
    finally:
        if old is None:
            os.environ.pop("MLASERVE_PDL")
        else:
            os.environ["MLASERVE_PDL"] = old
        pdl_launch.cache_clear()
    assert torch.equal(got_o, want_o) and torch.equal(got_y, want_y)
    batch = dict(live, q_nope=head_gemv(x, w_uk))
    _check(batch, got_o, lengths)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu, id="cuda")])
def test_warm_up_compiles_every_variant(device):
    """After `mla_decode_warm_up_tasks(max_bs=8, max_q_len=4)` ran, calls at every bs and q_len up
    to those compile nothing (q_len and num_splits are runtime values within a BLOCK_M bucket)."""
    from mlaserve.graph_runner.compile_watch import CompileWatch
    from mlaserve.ops.mla_decode import MlaDecodeWorkspace, mla_decode, mla_decode_warm_up_tasks

    heads, (rank, rope, page) = 24, DIMS[device]  # a head count no other test has
    kv = torch.zeros(8, page, rank + rope, dtype=FP8, device=device)
    scale = torch.ones(1, device=device)
    ws = MlaDecodeWorkspace(8, 4, heads, rank, device)
    qp_rows = torch.zeros(8 * 4, heads, 192, dtype=BF16, device=device)
    tasks = mla_decode_warm_up_tasks(
        kv, scale, heads, BF16, 8, 4, q_pe_strides=qp_rows.stride()[:2], workspace=ws
    )
    for task in tasks:
        task()
    watch = CompileWatch()
    watch.mark_ready()
    for q_len in range(1, 5):
        for bs in range(1, 9):
            t = bs * q_len
            q = torch.randn(t, heads, rank, device=device).to(BF16)
            bt = torch.randint(1, 8, (bs, 5), dtype=torch.int32, device=device)
            sl = torch.full((bs,), 200, dtype=torch.int32, device=device)
            mla_decode(q, qp_rows[:t, :, 128:], kv, scale, bt, sl, q_len, 0.1, workspace=ws)
    assert watch.compiles_since_ready == 0


@pytest.mark.parametrize("device", [cpu_case()])
def test_warm_up_runs(device):
    """The warm-up's calls run (under the interpreter here: tiny shapes)."""
    from mlaserve.ops.mla_decode import MlaDecodeWorkspace, mla_decode_warm_up_tasks

    rank, rope, page = DIMS["cpu"]
    kv = torch.zeros(2, page, rank + rope, dtype=F16)
    ws = MlaDecodeWorkspace(2, 2, 3, rank, "cpu")
    tasks = mla_decode_warm_up_tasks(kv, None, 3, F16, 2, 2, rope_dim=rope, workspace=ws)
    assert tasks
    for task in tasks:
        task()
    # max_rows bounds bs * q_len: 1 leaves bs 1 x q_len 1 alone, one variant
    bounded = mla_decode_warm_up_tasks(
        kv, None, 3, F16, 2, 2, max_rows=1, rope_dim=rope, workspace=ws
    )
    assert len(bounded) == 1


_AOT = r"""
import inspect, json, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from mlaserve.ops import mla_decode as M

cfg = M.MlaDecodeConfig()
result = {}

def build(name, fn, ptrs, consts, floats, warps, arch):
    sig = {p: "i32" for p in inspect.signature(fn.fn).parameters}
    sig.update(ptrs)
    sig.update({f: "fp32" for f in floats})
    sig.update({c: "constexpr" for c in consts})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, "num_stages": cfg.num_stages})
    spill = -1
    if arch == 90:  # ptxas -v on the PTX: registers and spill bytes
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o",
                              "/dev/null"], capture_output=True, text=True).stderr
        spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    result[f"sm{arch}/{name}"] = [len(k.asm["cubin"]), k.metadata.shared, spill]

# (q, kv, direct, block_d, archs): the serving pairs on both GPUs, the others on SM90
pairs = (("bf16", "fp8e4nv", False, cfg.block_d, (90, 100)),
         ("bf16", "fp8e4nv", True, cfg.block_d, (90,)),
         ("bf16", "bf16", False, cfg.block_d, (90, 100)),
         ("bf16", "bf16", True, cfg.block_d, (90,)),
         ("bf16", "fp8e4nv", False, 128, (90,)),  # the sliced score product
         ("fp16", "fp16", False, cfg.block_d, (90,)),
         ("fp32", "fp32", False, cfg.block_d, (90,)))
pairs += (("bf16", "fp8e4nv", False, cfg.block_d, (90, 100), cfg.wide_block_n),  # V3's heads
          ("bf16", "bf16", False, cfg.block_d, (90,), cfg.wide_block_n))
for q, kv, direct, block_d, archs, *wide in pairs:
    block_n = wide[0] if wide else cfg.block_n
    consts = dict(H=16, R=512, DR=64, PAGE=64, BLOCK_M=cfg.max_block_m, BLOCK_N=block_n,
                  BLOCK_R=512, BLOCK_D=block_d, BLOCK_DR=64, MIN_CHUNK=block_n,
                  FP8=kv == "fp8e4nv", DIRECT=direct, DOT_PREC="ieee" if q == "fp32" else "tf32",
                  WHILE_LOOP=False, PDL=True)
    ws = "*fp32" if not direct else f"*{q}"
    ptrs = {"q_nope_ptr": f"*{q}", "q_pe_ptr": f"*{q}", "kv_cache_ptr": f"*{kv}",
            "k_scale_ptr": "*fp32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
            "partial_ptr": ws, "lse_ptr": ws, "out_ptr": f"*{q}"}
    for arch in archs:
        name = f"split_{q}_{kv}_{'direct' if direct else 'ws'}_d{block_d}{'_wide' if wide else ''}"
        build(name, M._mla_split_kernel, ptrs, consts, ("qk_scale",), cfg.num_warps, arch)
for block_s, archs in ((2, (90,)), (64, (90, 100))):
    consts = dict(H=16, R=512, BLOCK_N=cfg.block_n, MIN_CHUNK=cfg.block_n, BLOCK_S=block_s,
                  BLOCK_R=M._combine_block_r(512, block_s), PDL=True)
    ptrs = {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16"}
    for arch in archs:
        build(f"combine_{block_s}", M._mla_combine_kernel, ptrs, consts, (), 4, arch)
print(json.dumps(result))
"""


def test_kernels_compile_for_sm90_and_sm100():
    """Both kernels lower to cubins for SM90 (H100) and SM100 (B200) without either GPU
    (Triton's ahead-of-time path, in a subprocess: TRITON_INTERPRET must not leak into it), so
    what the interpreter lets through but the compiler refuses fails here. The default tiles
    with bf16 q (fp8 or bf16 cache) and the combine must not spill registers on SM90; the wide
    tile (`wide_block_n`) spills at most 256 B."""
    pytest.importorskip("triton")
    import subprocess
    import sys
    from pathlib import Path

    from mlaserve.ops.mla_decode import MlaDecodeConfig
    from tests.aot_compile import SHARED_LIMIT

    block_d = MlaDecodeConfig().block_d

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 15, sorted(result)
    for name, (cubin_bytes, shared, spill) in result.items():
        assert cubin_bytes > 0, name
        assert shared <= SHARED_LIMIT, f"{name}: {shared} B of shared memory"
        serving = name.startswith("sm90/split_bf16_") and name.endswith(f"_d{block_d}")
        if serving or name.startswith("sm90/combine"):
            assert spill == 0, f"{name}: {spill} B of register spills"
        if name.startswith("sm90/split_bf16_") and name.endswith("_wide"):
            # measured faster than 8 warps, which do not spill (MlaDecodeConfig)
            assert spill <= 256, f"{name}: {spill} B of register spills"
