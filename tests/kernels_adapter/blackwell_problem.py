"""The problems both Blackwell test modules (CPU contract, SM100 GPU) run: DeepSeek's dims, a
paged pool with cached prefixes as the runner builds it (NaN-poisoned unused slots, shuffled
page tables, k_scale 0.5 for fp8), and the reference backend's answers to compare with. Needs
neither kernel package."""

from __future__ import annotations

import dataclasses
import random

import torch

from mlaserve.config import ModelConfig
from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.kernels_adapter.mha_extend import reference_extend_mha
from mlaserve.kernels_adapter.reference import ReferenceBackend
from mlaserve.kv_cache import MLAKVPool, PageAllocator

CPU = torch.device("cpu")
RANK, ROPE, NOPE, V_DIM, HEADS = 512, 64, 128, 128, 16  # DeepSeek dims, 16 heads (as shipped)
MAX_MODEL_LEN = 900  # 15 pages of 64, 29 of 32: the runner's table needs padding
PREFIX, Q_LENS = [0, 70, 5], [37, 20, 1]  # a first chunk, a chunk over a 70-token prefix, a decode


def deepseek_config(heads: int = HEADS, rank: int = RANK, rope: int = ROPE) -> ModelConfig:
    return ModelConfig(
        model_type="deepseek_v3",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=rank,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=rope,
        v_head_dim=V_DIM,
    )


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn)


@dataclasses.dataclass
class Problem:
    """A paged pool with cached prefixes and one batch of new tokens, as the runner builds it."""

    batch: ForwardBatch
    new_rows: torch.Tensor  # [T, 576] fp32, the new tokens' latent | k_pe
    cu: list[int]


def make_problem(
    backend,
    prefix_lens: list[int],
    q_lens: list[int],
    page_size: int,
    kv_dtype: torch.dtype,
    seed: int = 0,
) -> Problem:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    max_pages = -(-MAX_MODEL_LEN // page_size)  # the runner's full-width table
    num_pages = 2 + sum(-(-s // page_size) for s in seq_lens) + 3
    fp8 = kv_dtype == torch.float8_e4m3fn
    pool = MLAKVPool(1, num_pages, page_size, RANK, ROPE, kv_dtype, CPU, 0.5 if fp8 else 1.0)
    if fp8:
        pool.kv_buffers[0].view(torch.uint8).fill_(0x7F)  # e4m3 NaN: unused slots poison
    else:
        pool.kv_buffers[0].fill_(float("nan"))
    alloc = PageAllocator(num_pages)
    free = alloc.allocate(alloc.num_free_pages)
    rng.shuffle(free)
    tables, slots = [], []
    for s in seq_lens:
        pages = [free.pop() for _ in range(-(-s // page_size))]
        tables.append(pages + [0] * (max_pages - len(pages)))
        slots.append([pages[t // page_size] * page_size + t % page_size for t in range(s)])
    for b, p in enumerate(prefix_lens):
        if p:
            rows = torch.randn(p, RANK + ROPE)
            pool.write(0, torch.tensor(slots[b][:p]), rows[:, :RANK], rows[:, RANK:])
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    uniform = len(set(q_lens)) == 1 and q_lens[0] <= backend.max_q_len
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if uniform else ForwardMode.EXTEND,
        bs=len(q_lens),
        num_tokens=cu[-1],
        q_len=max(q_lens),
        max_seq_len=max(seq_lens),
        input_ids=torch.zeros(cu[-1], dtype=torch.long),
        positions=torch.zeros(cu[-1], dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_q_lens=torch.tensor(cu, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor([s for b, p in enumerate(prefix_lens) for s in slots[b][p:]]),
        logits_indices=torch.zeros(0, dtype=torch.long),
        kv_pool=pool,
        attn_backend=backend,
        seq_lens_host=None if uniform else seq_lens,
        q_lens_host=None if uniform else list(q_lens),
    )
    return Problem(batch=batch, new_rows=torch.randn(cu[-1], RANK + ROPE), cu=cu)


def reference_decode(problem: Problem, q: torch.Tensor) -> torch.Tensor:
    """The reference backend on a copy of the same pool and batch: [T, H, 512] fp32, built for
    the model and per-rank heads of the backend under test."""
    batch = problem.batch
    pool = batch.kv_pool
    twin = MLAKVPool(1, pool.num_pages, pool.page_size, RANK, ROPE, pool.dtype, CPU, pool.k_scales)
    twin.kv_buffers[0].view(torch.uint8).copy_(pool.kv_buffers[0].view(torch.uint8))
    src = batch.attn_backend
    ref = ReferenceBackend(
        src.model_config, pool.page_size, pool.dtype, CPU, batch.bs, 4096, num_heads=src.num_heads
    )
    rb = dataclasses.replace(batch, kv_pool=twin, attn_backend=ref)
    ref.prepare(rb)
    rows = problem.new_rows
    return ref.forward(0, q[..., :RANK], q[..., RANK:], rows[:, :RANK], rows[:, RANK:], rb)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def extend_inputs(problem: Problem, seed: int = 1):
    """q [T, H, 192], w_uk [H, 128, 512], w_uv [H, 512, 128], H the backend's heads a rank."""
    torch.manual_seed(seed)
    heads = problem.batch.attn_backend.num_heads
    q = torch.randn(problem.batch.num_tokens, heads, NOPE + ROPE)
    w_uk = torch.randn(heads, NOPE, RANK) / RANK**0.5
    w_uv = torch.randn(heads, RANK, V_DIM) / RANK**0.5
    return q, w_uk, w_uv


def reference_extend(problem: Problem, q, w_uk, w_uv, pool_bytes: torch.Tensor) -> torch.Tensor:
    """`reference_extend_mha` on a copy of the pool as it was before the call."""
    batch = problem.batch
    pool = batch.kv_pool
    twin = MLAKVPool(1, pool.num_pages, pool.page_size, RANK, ROPE, pool.dtype, CPU, pool.k_scales)
    twin.kv_buffers[0].view(torch.uint8).copy_(pool_bytes)
    rows = problem.new_rows
    return reference_extend_mha(
        0, q, rows[:, :RANK], rows[:, RANK:], w_uk, w_uv,
        dataclasses.replace(batch, kv_pool=twin), deepseek_config().softmax_scale,
    )  # fmt: skip


def decode_by_semantics(kw: dict, scale_key: str, out_scale_key: str) -> torch.Tensor:
    """What the kernels document they compute, in fp64, read off the adapter's arguments:
    out[b, i] = out_scale * softmax(scale * q[b, i] . K_b[:L - q_len + i + 1]) @ K_b[:, :512]."""
    q, cache, tables, seq_lens = kw["query"], kw["kv_cache"], kw["block_tables"], kw["seq_lens"]
    cache = cache.reshape(cache.shape[0], -1, cache.shape[-1])  # drop trtllm's head axis
    page = cache.shape[1]
    bs, q_len = q.shape[:2]
    out = torch.empty(bs, q_len, q.shape[2], RANK, dtype=torch.float64)
    for b in range(bs):
        n = int(seq_lens[b])
        pages = tables[b, : -(-n // page)].long()
        kv = cache[pages].reshape(-1, cache.shape[-1])[:n].double()
        scores = torch.einsum("qhd,sd->qhs", q[b].double(), kv) * kw[scale_key]
        hidden = torch.arange(n)[None, :] > torch.arange(n - q_len, n)[:, None]
        probs = torch.softmax(scores.masked_fill(hidden[:, None, :], float("-inf")), dim=-1)
        out[b] = torch.einsum("qhs,sc->qhc", probs, kv[:, :RANK]) * kw[out_scale_key]
    return out
