"""The batch-invariant MLA attention (`ops/invariant_mla_attention.py`): against an independent
fp32 torch reference, and invariant itself, bitwise.

The cache is NaN-poisoned everywhere but the sequences' written keys (the rest of their pages,
the pages past them, page 0), so a key read past a row's position turns its output NaN.
Reference: keys 0..p of the row's sequence dequantised to fp32, fp32 softmax and value sum,
written here from the cache layout alone (not the kernel's torch form). Tolerance:
4 eps(q dtype) * max |ref| + 2e-3 * |ref| absolute (q, keys and probabilities enter the
products in the query's dtype, bf16/fp16, and the result is rounded once to it); fp32 1e-5.

Invariance: the same query rows attended alone, in batches of 1, 3, 17 and 64 rows, and beside
garbage rows (huge queries of other sequences): identical bits.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.ops.invariant_rowwise import rowwise_mla_attention
from tests.ops.cases import cpu_case, gpu_case, model_dtype

# (heads, R, DR, page, cache dtype)
CPU_CASES = [
    cpu_case(3, 32, 16, 4, "dtype"),
    cpu_case(20, 32, 16, 8, "fp8"),  # two head blocks, the second partial
    cpu_case(4, 32, 16, 4, "fp32"),
]
GPU_CASES = [
    gpu_case(16, 512, 64, 64, "fp8"),  # the default model / V3-lite (16 heads)
    gpu_case(16, 512, 64, 64, "dtype"),
    gpu_case(128, 512, 64, 64, "fp8"),  # V3: 8 head blocks
    gpu_case(16, 512, 64, 16, "fp8"),
]
K_SCALE = 0.5


def _case(heads, r, dr, page, kind, device, lens):
    """A poisoned cache holding len(lens) sequences, their block tables, and query rows."""
    gen = torch.Generator(device=device).manual_seed(0)
    q_dtype = torch.float32 if kind == "fp32" else model_dtype(device)
    kv_dtype = {"fp8": torch.float8_e4m3fn, "dtype": q_dtype, "fp32": torch.float32}[kind]
    pages_per_seq = [-(-n // page) for n in lens]
    num_pages = 2 + sum(pages_per_seq) * 2
    values = torch.full((num_pages, page, r + dr), float("nan"), device=device)
    perm = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(1)) + 1
    tables = torch.zeros(len(lens), max(pages_per_seq) + 2, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        mine = perm[used : used + pages_per_seq[b]]
        used += pages_per_seq[b]
        tables[b, : len(mine)] = mine.to(torch.int32)
        tables[b, len(mine) :] = perm[-1].item()  # a stale page past the sequence: poison
        for p in range(n):
            values[mine[p // page], p % page] = torch.randn(r + dr, generator=gen, device=device)
    if kind == "fp8":  # stored = value / k_scale (the pool's writes), NaN stays NaN
        kv = (values / K_SCALE).to(torch.float8_e4m3fn)
    else:
        kv = values.to(kv_dtype)
    return kv, tables.to(device), q_dtype


def _reference(q_nope, q_pe, kv, k_scale, tables, row_seq, row_pos, scale):
    out = []
    fp8 = kv.dtype == torch.float8_e4m3fn
    page = kv.shape[1]
    for t in range(q_nope.shape[0]):
        b, p = int(row_seq[t]), int(row_pos[t])
        rows = [kv[tables[b, i // page], i % page].float() for i in range(p + 1)]
        keys = torch.stack(rows) * (k_scale if fp8 else 1.0)
        q = torch.cat([q_nope[t], q_pe[t]], -1).float()
        probs = torch.softmax(q @ keys.T * scale, -1)
        out.append(probs @ keys[:, : q_nope.shape[-1]])
    return torch.stack(out)


@pytest.mark.parametrize(("heads", "r", "dr", "page", "kind", "device"), [*CPU_CASES, *GPU_CASES])
def test_matches_fp32_reference_and_is_batch_invariant(heads, r, dr, page, kind, device):
    from mlaserve.ops.invariant_mla_attention import invariant_mla_attention

    lens = [37, 5, 70] if device == "cpu" else [1000, 33, 2100]
    kv, tables, q_dtype = _case(heads, r, dr, page, kind, device, lens)
    gen = torch.Generator(device=device).manual_seed(2)
    # 64 rows: every sequence's last keys, a prompt's first, and positions across tiles
    seqs, poss = [], []
    for i in range(64):
        b = i % len(lens)
        seqs.append(b)
        poss.append([lens[b] - 1, 0, (i * 7) % lens[b], min(31, lens[b] - 1)][i % 4])
    row_seq = torch.tensor(seqs, dtype=torch.int32, device=device)
    row_pos = torch.tensor(poss, dtype=torch.int32, device=device)
    q_nope = torch.randn(64, heads, r, generator=gen, device=device).to(q_dtype)
    q_pe_buf = torch.randn(64, heads, dr + 8, generator=gen, device=device).to(q_dtype)
    q_pe = q_pe_buf[..., :dr]  # strided, as MLA's split views are
    scale = 0.3
    args = (kv, K_SCALE, tables)
    out = invariant_mla_attention(q_nope, q_pe, *args, row_seq, row_pos, scale)
    assert not out.isnan().any()
    ref = _reference(q_nope, q_pe, kv, K_SCALE, tables, row_seq, row_pos, scale)
    eps = 1e-5 if q_dtype == torch.float32 else 4 * torch.finfo(q_dtype).eps
    tol = eps * ref.abs().amax() + 2e-3 * ref.abs()
    assert ((out.float() - ref).abs() <= tol).all(), (out.float() - ref).abs().max()
    if device == "cpu":  # the torch form agrees too (the CPU path of the mode)
        torch_form = rowwise_mla_attention(q_nope, q_pe, *args, row_seq, row_pos, scale)
        assert ((torch_form.float() - ref).abs() <= tol).all()
    for m in (1, 3, 17, 64):
        sl = slice(64 - m, 64)
        got = invariant_mla_attention(q_nope[sl], q_pe[sl], *args, row_seq[sl], row_pos[sl], scale)
        assert torch.equal(got, out[sl]), m
    # beside garbage rows: huge queries at other sequences' positions
    idx = torch.tensor([5, 6], device=device)
    g_nope = torch.cat([q_nope[idx], torch.full_like(q_nope[:9], 300.0)])
    g_pe = torch.cat([q_pe[idx], torch.full_like(q_pe[:9], -300.0)])
    g_seq = torch.cat([row_seq[idx], row_seq[:9].flip(0)])
    g_pos = torch.cat([row_pos[idx], torch.zeros_like(row_pos[:9])])
    got = invariant_mla_attention(g_nope, g_pe, *args, g_seq, g_pos, scale)
    assert torch.equal(got[:2], out[idx])


def test_torch_form_is_batch_invariant():
    kv, tables, _ = _case(2, 8, 4, 4, "fp32", "cpu", [9, 6])
    gen = torch.Generator().manual_seed(3)
    q_nope, q_pe = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 4, generator=gen)
    row_seq = torch.tensor([0, 0, 1, 1, 0], dtype=torch.int32)
    row_pos = torch.tensor([8, 3, 5, 0, 0], dtype=torch.int32)
    out = rowwise_mla_attention(q_nope, q_pe, kv, 1.0, tables, row_seq, row_pos, 0.5)
    assert not out.isnan().any()
    one = rowwise_mla_attention(
        q_nope[2:3], q_pe[2:3], kv, 1.0, tables, row_seq[2:3], row_pos[2:3], 0.5
    )
    assert torch.equal(one, out[2:3])
