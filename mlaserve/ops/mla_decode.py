"""MLA decode attention over the paged latent cache for small batches: a split-KV Triton kernel
and a small combine kernel, both launched with PDL (`ops/pdl.py`).

    q_nope       [T, H, r]      bf16 / fp16 / fp32, the absorbed query (q_nope @ W_UK); any
                                strides with a contiguous last dim. T = bs * q_len: rows
                                b * q_len .. (b + 1) * q_len - 1 are sequence b's new tokens
    q_pe         [T, H, d_r]    q_nope's dtype, RoPE applied; same stride rule
    kv_cache     [P, page, r + d_r]  one layer's buffer of `kv_cache/kv_pool.py` (last dim
                                contiguous): float8_e4m3fn (value = stored * k_scale) or
                                bf16 / fp16 / fp32 (the values; k_scale is not applied)
    k_scale      [1] fp32       the layer's scale (`MLAKVPool.k_scale_tensors[layer]`), read on
                                the device; only used (and required) for an fp8 cache
    block_tables [bs, max_pages] int32, last dim contiguous; token n of sequence b is row
                                n % page of page block_tables[b, n // page]
    seq_lens     [bs] int32     KV length of each sequence, this step's q_len tokens included
                                (seq_lens, block_tables and k_scale are read before the PDL
                                wait: the kernel launched right before this one must not
                                write them, `ops/pdl.py`; the decode prologue does not)
    returns      [T, H, r]      q_nope's dtype (into `out` when given: any strides with a
                                contiguous last dim)

Query row i (0-based in its sequence) of sequence b, L = seq_lens[b], attends keys
0 .. L - q_len + i (causal among the new tokens): softmax(q . k * softmax_scale) @ c_kv with
q = [q_nope | q_pe], k = [c_kv | k_pe], fp32 scores, softmax and accumulation (the
probabilities are rounded to q's dtype for the P @ V tensor-core product, as in every flash
kernel). Nothing past a sequence's length is read, so stale or NaN pages never leak in. Padded
rows of a CUDA graph (seq_len = q_len, page-table row of zeros) read page 0 and stay finite.
A row that sees no key at all (seq_len < q_len, never in a valid batch) comes out 0.

Why: at decode batch sizes of 1-8 sequences FlashMLA's cost is mostly fixed (a schedule-metadata
kernel per forward, a split-KV kernel and its combine per layer: library kernels that cannot
launch early under PDL). Here two PDL kernels per layer, no metadata kernel:

1. split (grid bs x num_splits x head_groups): one program takes up to BLOCK_M of the
   sequence's q_len * H query rows (row m = i * H + h) over one chunk of its keys. It walks
   the chunk in BLOCK_N-key steps through the page table (the next step's page ids load with
   this step's keys; q is reloaded every step from L1 rather than held in registers), scores
   by `tl.dot` into fp32 (an fp8 cache is converted to q's dtype for the products, its
   k_scale folded into the score scale and the output), keeps an online softmax and writes
   its normalised fp32 partial output and log2-sum-exp to the workspace.
2. combine (grid T x H x r-blocks): weights each valid split's partial by exp2(lse - max) and
   writes the output in q's dtype.

num_splits is a host int (`choose_num_splits`: from bs, q_len, H and the SM count only), so the
grids are fixed per captured graph. The chunk of a split is computed on the device from the
sequence's length: chunk = max(round_up(ceil(L / num_splits), BLOCK_N), min_chunk), split s
covers keys [s * chunk, min((s + 1) * chunk, L)); splits starting at or past L load and store
nothing, and the combine reads only the ceil(L / chunk) valid ones. With num_splits == 1 the
split kernel writes the output itself and the combine is not launched. Launches read no device
value on the host: CUDA-graph safe.

Workspace (`MlaDecodeWorkspace`, preallocated once; fp32, contiguous; row = (t, h, s)):

    partial  [rows, r]  row (t * H + h) * num_splits + s: split s's normalised output of (t, h)
    lse      [rows]     same rows: log2 of the split's softmax denominator plus its max score
                        (log2 units: scores are pre-multiplied by log2(e)); -inf for a row that
                        sees no key in the split

A call needs T * H * num_splits rows (none when num_splits == 1); `mla_decode` lowers
num_splits to what the workspace holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel
from mlaserve.ops.triton_support import interpreting

__all__ = [
    "MLA_DECODE_MAX_Q_LEN",
    "MlaDecodeConfig",
    "MlaDecodeWorkspace",
    "block_n_for",
    "choose_num_splits",
    "head_groups",
    "mla_decode",
    "mla_decode_warm_up_tasks",
    "mla_decode_workspace_rows",
]

# Uniform decode / verify batches (the adapter's `max_uniform_q_len`); the kernel takes any.
MLA_DECODE_MAX_Q_LEN = 16
_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KV_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)
_LOG2E = math.log2(math.e)
_COMBINE_TILE = 4096  # fp32 elements of a combine program's [BLOCK_S, BLOCK_R] partials tile
_INTERPRETER_SMS = 4  # CPU (Triton's interpreter): few splits, fast tests


@dataclass(frozen=True)
class MlaDecodeConfig:
    """Tiles of the split kernel and the split rule. `block_n` is the fastest of
    `bench/mla_decode.py --sweep` at bs 1, ctx 1024, fp8 cache, 16 heads on an H100 (7.2 us per
    layer, against 8.3 us for block_n 32 at 8 warps; bench/RESULTS.md) among tiles that compile
    for SM90 (Triton 3.6 and its bundled ptxas 12.8) without register spills, with bf16 q and an
    fp8 or bf16 cache (`test_kernels_compile_for_sm90_and_sm100` keeps it so). Calls of at
    least `wide_min_rows` query rows (bs * q_len * H: V3's 32-128 heads a rank, or 16 heads
    from two tokens) take `wide_block_n` instead: half the key steps, a quarter faster on V3's
    TP2 share at 4 tokens or at ctx 4096, about even at one token and ctx 1024 (H200;
    bench/RESULTS.md, thirty-third session), though it spills 132 B of registers at 4 warps (8
    warps do not spill, and ran slower; the compile test bounds the spill).

    max_block_m: query rows (of q_len * H) per program, a power of two >= 16 (`tl.dot`'s least
        M). More rows make fewer head groups (each reads the chunk's KV again, from L2)
    block_n, wide_block_n: keys per loop step, a power of two >= 16; chunks are multiples of it
        (64 spills)
    wide_min_rows: the least bs * q_len * H that takes wide_block_n
    block_d: the score product's slice of r per step; below r the key tile is loaded in slices
        and again whole for P @ V (256 spills)
    min_chunk_blocks: a split takes at least this many blocks of keys: each split writes
        BLOCK_M * r * 4 bytes of partials, which short chunks make outweigh the KV they read
    programs_per_sm, max_splits: `choose_num_splits`
    num_stages: the key loop is not software-pipelined by Triton (indirect page-table loads),
        so stages change nothing today
    """

    max_block_m: int = 16
    block_n: int = 16
    wide_block_n: int = 32
    wide_min_rows: int = 32
    block_d: int = 512
    num_warps: int = 4
    num_stages: int = 1
    min_chunk_blocks: int = 1
    programs_per_sm: int = 2
    max_splits: int = 64

    def __post_init__(self) -> None:
        for name in ("max_block_m", "block_n", "wide_block_n", "block_d"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MlaDecodeConfig.{name}: a power of two >= 16, got {v}")
        if (
            min(self.min_chunk_blocks, self.programs_per_sm, self.max_splits, self.wide_min_rows)
            < 1
        ):
            raise ValueError(
                "MlaDecodeConfig: min_chunk_blocks, programs_per_sm, max_splits and wide_min_rows "
                "must be >= 1"
            )


_DEFAULT_CONFIG = MlaDecodeConfig()


def _block_m(rows: int, config: MlaDecodeConfig) -> int:
    return min(config.max_block_m, max(16, triton.next_power_of_2(rows)))


def block_n_for(query_rows: int, config: MlaDecodeConfig = _DEFAULT_CONFIG) -> int:
    """Keys per loop step of a call with `query_rows` = bs * q_len * H query rows."""
    return config.wide_block_n if query_rows >= config.wide_min_rows else config.block_n


def head_groups(q_len: int, num_heads: int, config: MlaDecodeConfig = _DEFAULT_CONFIG) -> int:
    """Programs per (sequence, split): the q_len * H query rows in BLOCK_M-row groups."""
    rows = q_len * num_heads
    return triton.cdiv(rows, _block_m(rows, config))


def choose_num_splits(
    bs: int, q_len: int, num_heads: int, num_sms: int, config: MlaDecodeConfig = _DEFAULT_CONFIG
) -> int:
    """KV splits per (sequence, head group): enough for about `programs_per_sm` (2) programs
    per SM, clamp(ceil(2 * num_sms / (bs * head_groups)), 1, max_splits). Host ints only (the
    grid is fixed per captured graph); on the device a sequence shorter than
    num_splits * BLOCK_N keys uses fewer (the others exit at once)."""
    programs = bs * head_groups(q_len, num_heads, config)
    target = config.programs_per_sm * num_sms
    return max(1, min(config.max_splits, -(-target // programs)))


def mla_decode_workspace_rows(
    max_bs: int,
    max_q_len: int,
    num_heads: int,
    num_sms: int,
    config: MlaDecodeConfig = _DEFAULT_CONFIG,
) -> int:
    """Workspace rows every batch of <= max_bs sequences x <= max_q_len tokens needs:
    max of bs * q_len * H * num_splits over those with num_splits > 1 (0 if none)."""
    need = 0
    for bs in range(1, max_bs + 1):
        for q_len in range(1, max_q_len + 1):
            splits = choose_num_splits(bs, q_len, num_heads, num_sms, config)
            if splits > 1:
                need = max(need, bs * q_len * num_heads * splits)
    return need


def _combine_block_r(rank: int, block_s: int) -> int:
    """Latent columns per combine program: its [BLOCK_S, BLOCK_R] fp32 tile <= _COMBINE_TILE."""
    return min(triton.next_power_of_2(rank), max(16, _COMBINE_TILE // block_s))


def _use_while() -> bool:
    """Whether the split kernel walks its keys in a `while` loop instead of a `range` (the form
    compiled for GPUs): under the interpreter, whose scalars are 1-element numpy arrays that
    numpy >= 2.4 will not turn into a `range` bound. The loop body is the same function."""
    return interpreting()


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


class MlaDecodeWorkspace:
    """The split kernel's fp32 partials and log2-sum-exps (layout in the module docstring),
    sized by `mla_decode_workspace_rows` for batches up to max_bs x max_q_len, allocated once
    (shared by all layers: the layers' calls run one after another)."""

    def __init__(
        self,
        max_bs: int,
        max_q_len: int,
        num_heads: int,
        rank: int,
        device: torch.device | str,
        *,
        num_sms: int | None = None,
        config: MlaDecodeConfig = _DEFAULT_CONFIG,
    ) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.num_sms = _num_sms(device) if num_sms is None else num_sms
        self.rows = mla_decode_workspace_rows(max_bs, max_q_len, num_heads, self.num_sms, config)
        self.rank = rank
        self.partial = torch.empty(max(self.rows, 1), rank, dtype=torch.float32, device=device)
        self.lse = torch.empty(max(self.rows, 1), dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return self.partial.numel() * 4 + self.lse.numel() * 4


@triton.jit
def _chunk_len(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Keys per split of a sequence of `seq_len` keys: a multiple of BLOCK_N, >= MIN_CHUNK.
    Both kernels call this: they must agree on which splits are valid."""
    per = tl.cdiv(seq_len, num_splits)
    per = tl.cdiv(per, BLOCK_N) * BLOCK_N
    return tl.maximum(per, MIN_CHUNK)


@triton.jit
def _block_pages(block_table_row, n0, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Page ids of keys n0 .. n0 + BLOCK_N - 1 (0 for those >= end: never dereferenced)."""
    keys = n0 + tl.arange(0, BLOCK_N)
    return tl.load(block_table_row + keys // PAGE, mask=keys < end, other=0)


@triton.jit
def _attend_block(
    n0, end, page, last, scale, q_nope_rows, q_pe_rows, mask_m, m_i, l_i, acc,
    kv_cache_ptr, kv_cache_stride_page, kv_cache_stride_row,
    R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys n0 .. n0 + BLOCK_N - 1 in pages `page` (those < end
    loaded, those past a row's `last` masked): -> the updated (m_i, l_i, acc).

    q is loaded again every step (L1 hits): a [BLOCK_M, r] q held live across the loop sits in
    every warp's registers (the tensor-core A operand is replicated across the warps that split
    N) and spills. With BLOCK_D < r the scores are summed over BLOCK_D-wide slices of q and the
    keys, and the values' tile is loaded again whole (L1 hits)."""
    keys = n0 + tl.arange(0, BLOCK_N)
    valid = keys < end
    kv_rows = (
        kv_cache_ptr
        + page.to(tl.int64) * kv_cache_stride_page
        + (keys % PAGE) * kv_cache_stride_row
    )
    dtype = q_nope_rows.dtype.element_ty
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dr = offs_dr < DR
    q_pe = tl.load(q_pe_rows[:, None] + offs_dr[None, :], mask=mask_m[:, None] & mask_dr[None, :],
                   other=0.0)  # fmt: skip
    pe = tl.load(kv_rows[:, None] + R + offs_dr[None, :], mask=valid[:, None] & mask_dr[None, :],
                 other=0.0).to(dtype)  # fmt: skip
    qk = tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N] fp32
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    if BLOCK_D >= BLOCK_R:  # one slice: the keys' tile is the values' tile
        q = tl.load(q_nope_rows[:, None] + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :],
                    other=0.0)  # fmt: skip
        c = tl.load(kv_rows[:, None] + offs_r[None, :], mask=valid[:, None] & mask_r[None, :],
                    other=0.0).to(dtype)  # fmt: skip
        qk = tl.dot(q, tl.trans(c), qk, input_precision=DOT_PREC)
    else:
        for d0 in tl.static_range(0, BLOCK_R, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < R
            q = tl.load(q_nope_rows[:, None] + offs_d[None, :],
                        mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
            k = tl.load(kv_rows[:, None] + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0).to(dtype)  # fmt: skip
            qk = tl.dot(q, tl.trans(k), qk, input_precision=DOT_PREC)
        c = tl.load(kv_rows[:, None] + offs_r[None, :], mask=valid[:, None] & mask_r[None, :],
                    other=0.0).to(dtype)  # fmt: skip
    qk = tl.where(keys[None, :] <= last[:, None], qk * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: no -inf - -inf
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(dtype), c, input_precision=DOT_PREC)
    return m_new, l_i, acc


# q_len, num_splits and the page table's row stride are runtime values (not specialised): one
# compile serves every batch size of a BLOCK_M bucket and any page-table width.
@triton.jit(do_not_specialize=["q_len", "num_splits", "block_tables_stride_seq"])
def _mla_split_kernel(
    q_nope_ptr, q_pe_ptr, kv_cache_ptr, k_scale_ptr, block_tables_ptr, seq_lens_ptr,
    partial_ptr, lse_ptr, out_ptr,
    q_len, num_splits, qk_scale,
    q_nope_stride_token, q_nope_stride_head, q_pe_stride_token, q_pe_stride_head,
    kv_cache_stride_page, kv_cache_stride_row, block_tables_stride_seq,
    out_stride_token, out_stride_head,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DR: tl.constexpr, MIN_CHUNK: tl.constexpr, FP8: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PREC: tl.constexpr, WHILE_LOOP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (b, s, g): query rows g * BLOCK_M .. (g + 1) * BLOCK_M - 1 (row m = i * H + h)
    of sequence b over split s's chunk of its keys.

    Layouts: strides in elements, every last dim contiguous; H, R, DR, PAGE are the module
    doc's H, r, d_r, page; token row t = b * q_len + i.

        q_nope    [T, H, R]          (t, h) at t * q_nope_stride_token + h * q_nope_stride_head
        q_pe      [T, H, DR]         (t, h) at t * q_pe_stride_token + h * q_pe_stride_head
        kv_cache  [P, PAGE, R + DR]  key row n of page p at p * kv_cache_stride_page
                                     + (n % PAGE) * kv_cache_stride_row; c_kv = [:R], k_pe = [R:]
        block_tables  [bs, max_pages] int32: sequence b's row at b * block_tables_stride_seq
        seq_lens  [bs] int32;  k_scale [1] fp32 (read only when FP8)
        out       [T, H, R]          (t, h) at t * out_stride_token + h * out_stride_head;
                                     written only when DIRECT (num_splits == 1)
        partial   [T * H * num_splits, R] fp32 and lse [T * H * num_splits] fp32, contiguous:
                  the workspace (module doc), written unless DIRECT
    """
    b = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.program_id(2)
    offs_m = g * BLOCK_M + tl.arange(0, BLOCK_M)  # query row m = i * H + h of sequence b
    mask_m = offs_m < q_len * H
    qi = offs_m // H
    hh = offs_m % H
    t = b * q_len + qi  # token row
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    q_nope_rows = q_nope_ptr + t * q_nope_stride_token + hh * q_nope_stride_head
    q_pe_rows = q_pe_ptr + t * q_pe_stride_token + hh * q_pe_stride_head

    # The lengths and page tables are the step's inputs, written before the first layer, and
    # k_scale is the layer's constant: none is the previous kernel's (the decode prologue's),
    # so they are read before the wait (`ops/pdl.py`), and the first page ids with them: after
    # the wait a program's first keys are one load away instead of three dependent ones.
    seq_len = tl.load(seq_lens_ptr + b)
    chunk = _chunk_len(seq_len, num_splits, BLOCK_N, MIN_CHUNK)
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)
    block_table_row = block_tables_ptr + b.to(tl.int64) * block_tables_stride_seq
    page = _block_pages(block_table_row, start, end, PAGE, BLOCK_N)  # none for an empty split
    scale = qk_scale  # softmax_scale * log2(e): exp2 below
    out_scale = 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr)
        scale = scale * k_scale
        out_scale = k_scale
    wait_for_previous_kernel(PDL)  # q and this step's KV rows are the previous kernel's output
    if start < seq_len:  # else: an empty split, nothing loaded or stored (the combine skips it)
        # the last key row i sees; -1 for rows past q_len * H (they see nothing)
        last = tl.where(mask_m, seq_len - q_len + qi, -1)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        # The next block's page ids load with this block's keys (one dependent load less a step)
        if WHILE_LOOP:  # the interpreter: its scalars cannot bound a `range` (see _use_while)
            n0 = start
            while n0 < end:
                next_page = _block_pages(block_table_row, n0 + BLOCK_N, end, PAGE, BLOCK_N)
                m_i, l_i, acc = _attend_block(
                    n0, end, page, last, scale, q_nope_rows, q_pe_rows, mask_m, m_i, l_i, acc,
                    kv_cache_ptr, kv_cache_stride_page, kv_cache_stride_row,
                    R, DR, PAGE, BLOCK_N, BLOCK_R, BLOCK_D, BLOCK_DR, DOT_PREC,
                )  # fmt: skip
                page = next_page
                n0 += BLOCK_N
        else:
            for n0 in range(start, end, BLOCK_N):
                next_page = _block_pages(block_table_row, n0 + BLOCK_N, end, PAGE, BLOCK_N)
                m_i, l_i, acc = _attend_block(
                    n0, end, page, last, scale, q_nope_rows, q_pe_rows, mask_m, m_i, l_i, acc,
                    kv_cache_ptr, kv_cache_stride_page, kv_cache_stride_row,
                    R, DR, PAGE, BLOCK_N, BLOCK_R, BLOCK_D, BLOCK_DR, DOT_PREC,
                )  # fmt: skip
                page = next_page
        # a row that saw no key here has acc = 0, l_i = 0: it stores 0 (and lse -inf)
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc * (out_scale / l_safe)[:, None]
        if DIRECT:
            out_rows = out_ptr + t * out_stride_token + hh * out_stride_head
            tl.store(
                out_rows[:, None] + offs_r[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=mask_m[:, None] & mask_r[None, :],
            )
        else:
            ws_row = (t.to(tl.int64) * H + hh) * num_splits + s
            tl.store(
                partial_ptr + ws_row[:, None] * R + offs_r[None, :],
                o,
                mask=mask_m[:, None] & mask_r[None, :],
            )
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(lse_ptr + ws_row, lse, mask=mask_m)


@triton.jit(do_not_specialize=["q_len", "num_splits"])
def _mla_combine_kernel(
    partial_ptr, lse_ptr, seq_lens_ptr, out_ptr,
    q_len, num_splits, out_stride_token, out_stride_head,
    H: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_s = tl.arange(0, BLOCK_S)
    ws_row = (t.to(tl.int64) * H + h) * num_splits

    seq_len = tl.load(seq_lens_ptr + t // q_len)  # a step input: before the wait, as above
    valid = offs_s < tl.cdiv(seq_len, _chunk_len(seq_len, num_splits, BLOCK_N, MIN_CHUNK))
    wait_for_previous_kernel(PDL)  # the partials are the split kernel's output
    lse = tl.load(lse_ptr + ws_row + offs_s, mask=valid, other=float("-inf"))
    part = tl.load(
        partial_ptr + (ws_row + offs_s)[:, None] * R + offs_r[None, :],
        mask=valid[:, None] & mask_r[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_R]
    mx = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))  # 0 for invalid splits
    denom = tl.sum(w, axis=0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)  # none: 0
    out_row = out_ptr + t * out_stride_token + h * out_stride_head
    tl.store(out_row + offs_r, o.to(out_ptr.dtype.element_ty), mask=mask_r)


def _check(q_nope, q_pe, kv_cache, k_scale, block_tables, seq_lens, q_len, out) -> None:
    def fail(msg: str) -> None:
        raise ValueError(f"mla_decode: {msg}")

    if q_nope.dim() != 3 or q_pe.dim() != 3 or kv_cache.dim() != 3:
        fail(f"q_nope {list(q_nope.shape)}, q_pe {list(q_pe.shape)} and kv_cache "
             f"{list(kv_cache.shape)} must be 3-D")  # fmt: skip
    num_tokens, heads, rank = q_nope.shape
    rope = q_pe.shape[2]
    if q_pe.shape[:2] != (num_tokens, heads) or kv_cache.shape[2] != rank + rope:
        fail(f"q_nope {list(q_nope.shape)}, q_pe {list(q_pe.shape)} and kv_cache "
             f"{list(kv_cache.shape)} do not fit (kv rows are [c_kv | k_pe])")  # fmt: skip
    if rank % 16 or rope % 16:
        fail(f"kv_lora_rank {rank} and rope dim {rope} must be multiples of 16")
    if q_nope.dtype not in _Q_DTYPES or q_pe.dtype != q_nope.dtype:
        fail(f"q_nope {q_nope.dtype} and q_pe {q_pe.dtype} must be one of bf16 / fp16 / fp32")
    if kv_cache.dtype not in _KV_DTYPES:
        fail(f"kv_cache dtype {kv_cache.dtype}: expected fp8_e4m3fn, bf16, fp16 or fp32")
    if q_nope.stride(2) != 1 or q_pe.stride(2) != 1 or kv_cache.stride(2) != 1:
        fail("q_nope, q_pe and kv_cache need a contiguous last dim")
    if not 1 <= q_len <= MLA_DECODE_MAX_Q_LEN or num_tokens % q_len:
        fail(f"{num_tokens} token rows are not bs x q_len with q_len {q_len} in "
             f"1..{MLA_DECODE_MAX_Q_LEN}")  # fmt: skip
    bs = num_tokens // q_len
    if seq_lens.shape != (bs,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        fail(f"seq_lens must be [{bs}] int32 contiguous, got {list(seq_lens.shape)} "
             f"{seq_lens.dtype}")  # fmt: skip
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != bs
        or block_tables.dtype != torch.int32
        or block_tables.stride(1) != 1
    ):
        fail(f"block_tables must be [{bs}, max_pages] int32 with a contiguous last dim, got "
             f"{list(block_tables.shape)} {block_tables.dtype}")  # fmt: skip
    if kv_cache.dtype == torch.float8_e4m3fn and (
        k_scale is None or k_scale.numel() != 1 or k_scale.dtype != torch.float32
    ):
        fail("an fp8 cache needs k_scale, an fp32 tensor of one element")
    tensors = [q_nope, q_pe, kv_cache, block_tables, seq_lens]
    tensors += [x for x in (k_scale, out) if x is not None]
    if any(x.device != q_nope.device for x in tensors):
        fail("all tensors must be on one device")
    if out is not None and (
        out.shape != (num_tokens, heads, rank) or out.dtype != q_nope.dtype or out.stride(2) != 1
    ):
        fail(f"out must be [{num_tokens}, {heads}, {rank}] {q_nope.dtype}, last dim unit")


class _Scratch:
    """A per-call workspace (when the caller gives none): exactly the rows this call needs."""

    def __init__(self, rows: int, rank: int, device: torch.device) -> None:
        self.rows, self.rank = rows, rank
        self.partial = torch.empty(rows, rank, dtype=torch.float32, device=device)
        self.lse = torch.empty(rows, dtype=torch.float32, device=device)


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_len: int,
    softmax_scale: float,
    *,
    workspace: MlaDecodeWorkspace | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MlaDecodeConfig = _DEFAULT_CONFIG,
) -> torch.Tensor:
    """Attention of the T = bs * q_len query rows over their sequences' paged latent KV:
    [T, H, r] in q's dtype (into `out` when given). Shapes, layouts and semantics in the module
    docstring. `workspace`: preallocated partials (allocated per call when None and needed);
    `num_splits`: overrides `choose_num_splits` (tests, benchmarks). Raises ValueError on
    inputs that do not fit."""
    _check(q_nope, q_pe, kv_cache, k_scale, block_tables, seq_lens, q_len, out)
    num_tokens, heads, rank = q_nope.shape
    rope = q_pe.shape[2]
    bs = num_tokens // q_len
    device = q_nope.device
    if out is None:
        out = torch.empty(num_tokens, heads, rank, dtype=q_nope.dtype, device=device)
    if num_tokens == 0:
        return out
    if num_splits is None:
        sms = workspace.num_sms if workspace is not None else _num_sms(device)
        num_splits = choose_num_splits(bs, q_len, heads, sms, config)
    num_splits = max(1, num_splits)
    rows = num_tokens * heads
    if num_splits > 1:
        if workspace is None:
            workspace = _Scratch(rows * num_splits, rank, device)
        elif workspace.rank != rank or workspace.partial.device != device:
            raise ValueError(f"mla_decode: the workspace is for rank {workspace.rank} on "
                             f"{workspace.partial.device}, not {rank} on {device}")  # fmt: skip
        num_splits = min(num_splits, workspace.rows // rows)  # what it holds
    direct = num_splits <= 1
    num_splits = max(1, num_splits)
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    block_m = _block_m(q_len * heads, config)
    block_n = block_n_for(rows, config)
    min_chunk = block_n * config.min_chunk_blocks
    pdl = pdl_args(device)
    part = workspace.partial if not direct else out  # unused pointers when direct
    lse = workspace.lse if not direct else out
    grid = (bs, num_splits, triton.cdiv(q_len * heads, block_m))
    _mla_split_kernel[grid](
        q_nope, q_pe, kv_cache, k_scale if fp8 else seq_lens, block_tables, seq_lens,
        part, lse, out,
        q_len, num_splits, float(softmax_scale) * _LOG2E,
        q_nope_stride_token=q_nope.stride(0), q_nope_stride_head=q_nope.stride(1),
        q_pe_stride_token=q_pe.stride(0), q_pe_stride_head=q_pe.stride(1),
        kv_cache_stride_page=kv_cache.stride(0), kv_cache_stride_row=kv_cache.stride(1),
        block_tables_stride_seq=block_tables.stride(0),
        out_stride_token=out.stride(0), out_stride_head=out.stride(1),
        H=heads, R=rank, DR=rope, PAGE=kv_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_D=min(config.block_d, triton.next_power_of_2(rank)),
        BLOCK_DR=triton.next_power_of_2(rope), MIN_CHUNK=min_chunk, FP8=fp8, DIRECT=direct,
        DOT_PREC="ieee" if q_nope.dtype == torch.float32 else "tf32", WHILE_LOOP=_use_while(),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl,
    )  # fmt: skip
    if direct:
        return out
    block_s = triton.next_power_of_2(num_splits)
    block_r = _combine_block_r(rank, block_s)
    _mla_combine_kernel[(num_tokens, heads, triton.cdiv(rank, block_r))](
        workspace.partial, workspace.lse, seq_lens, out,
        q_len, num_splits, out_stride_token=out.stride(0), out_stride_head=out.stride(1),
        H=heads, R=rank, BLOCK_N=block_n, MIN_CHUNK=min_chunk,
        BLOCK_S=block_s, BLOCK_R=block_r, num_warps=4, **pdl,
    )  # fmt: skip
    return out


def mla_decode_warm_up_tasks(
    kv_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    num_heads: int,
    q_dtype: torch.dtype,
    max_bs: int,
    max_q_len: int,
    *,
    max_rows: int | None = None,
    rope_dim: int = 64,
    q_pe_strides: tuple[int, int] | None = None,
    workspace: MlaDecodeWorkspace | None = None,
    config: MlaDecodeConfig = _DEFAULT_CONFIG,
) -> list[Callable[[], None]]:
    """One task per kernel variant that batches of 1..max_bs sequences x 1..max_q_len tokens
    (bs * q_len <= `max_rows`, when given) use (BLOCK_M bucket, BLOCK_N, direct or split +
    combine, the combine's tiles) for this cache and q dtype, so that none compiles while
    serving. Each runs its variant once on page 0 of `kv_cache` (read only; its output is
    discarded) with `workspace`'s partials, so tasks that run beside serving-shaped forwards
    (the engine's start-up: `model/kernel_warm_up.py`) take a workspace and a cache of their
    own. q_nope is taken contiguous; `q_pe_strides` (token, head): its layout when it is a view
    into wider rows (Triton specialises on their divisibility)."""
    device = kv_cache.device
    rank = kv_cache.shape[2] - rope_dim
    sms = workspace.num_sms if workspace is not None else _num_sms(device)
    seen: dict[tuple, tuple[int, int]] = {}
    for q_len in range(1, min(max_q_len, MLA_DECODE_MAX_Q_LEN) + 1):
        for bs in range(1, max_bs + 1):
            if max_rows is not None and bs * q_len > max_rows:
                break
            rows = bs * q_len * num_heads
            splits = choose_num_splits(bs, q_len, num_heads, sms, config)
            if workspace is not None:
                splits = min(splits, workspace.rows // rows)
            key = (_block_m(q_len * num_heads, config), block_n_for(rows, config), splits <= 1)
            if splits > 1:
                block_s = triton.next_power_of_2(splits)
                key += (block_s, _combine_block_r(rank, block_s))
            seen.setdefault(key, (bs, q_len))
    args = (kv_cache, k_scale, num_heads, q_dtype, rope_dim, q_pe_strides, workspace, config)
    return [functools.partial(_run_once, bs, q_len, *args) for bs, q_len in seen.values()]


def _run_once(
    bs: int,
    q_len: int,
    kv_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    num_heads: int,
    q_dtype: torch.dtype,
    rope_dim: int,
    q_pe_strides: tuple[int, int] | None,
    workspace: MlaDecodeWorkspace | None,
    config: MlaDecodeConfig,
) -> None:
    device, t = kv_cache.device, bs * q_len
    rank = kv_cache.shape[2] - rope_dim
    q_nope = torch.zeros(t, num_heads, rank, dtype=q_dtype, device=device)
    if q_pe_strides is None:
        q_pe = torch.zeros(t, num_heads, rope_dim, dtype=q_dtype, device=device)
    else:
        buf = torch.zeros(t * q_pe_strides[0], dtype=q_dtype, device=device)
        q_pe = buf.as_strided((t, num_heads, rope_dim), (*q_pe_strides, 1))
    mla_decode(
        q_nope, q_pe, kv_cache, k_scale,
        torch.zeros(bs, 1, dtype=torch.int32, device=device),
        torch.full((bs,), q_len, dtype=torch.int32, device=device),
        q_len, 1.0, workspace=workspace, config=config,
    )  # fmt: skip
