"""Test helper: the steps the tensor-parallel tests run on every rank and on one (TP1).

`model_steps(tp, path, keep_fp8)` loads the checkpoint at `path` with `tp` and runs, over the
paged cache and the reference backend (`paged.PagedCache`, `parity_setup.forward`: the path of
the model parity tests), in float32 on the CPU:

    prefill   one ragged EXTEND of PROMPT_LENS prompts
    decode    DECODE_STEPS steps of one token per sequence (teacher-forced, fixed tokens)
    mtp       (when the checkpoint has an MTP layer) the MTP module over each prompt: an EXTEND
              of rows 0..L-2, then one DECODE step, fed the main model's hidden states

and returns each phase's logits [rows, vocab] (every rank returns the full vocabulary). The
same function with `NO_TP` is the TP1 baseline.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mlaserve.config import ModelConfig
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.model import DeepseekForCausalLM, load_model
from mlaserve.tensor_parallel import NO_TP, TensorParallel
from tests.model.paged import PagedCache
from tests.model.parity_setup import forward

# fp32 weights and activations: TP only reorders sums (o_proj / down / experts split over K,
# then one all-reduce). Measured 2026-11-27 (CPU, gloo): max_rel 4.5e-7 - 7.6e-7 per phase and
# case. Bound: 1e-5.
FP32_MAX_REL = 1e-5
# FP8 block weights kept FP8 (CPU emulation of the block-FP8 GEMMs, activations quantised per
# 128-wide group): an input a float32 rounding away from TP1's can land on the other side of an
# e4m3 step (or of a routing near-tie) and move a whole row. Measured 2026-11-27: one decode row
# of 15 at 8.3e-3, every other row of prefill and decode <= 5e-7 (the dense-only variant: <= 4e-7
# on every row); 2026-11-29, another CPU machine (the same code): a prefill row at 1.64e-2 and
# the decode row at 2.16e-2 (which inputs flip depends on the host's float32 summation order). An e4m3 step is 1/8 of its
# value, so one flipped input can move a row by a few percent. Bounds: each row 5e-2, the
# median row 1e-6, argmax equal everywhere.
FP8_MAX_REL = 5e-2
FP8_MEDIAN_ROW_REL = 1e-6
# A tiny V3 whose every TP2 split lands on a 128 boundary (q_b 256 rows, o_proj 256 columns,
# dense / shared / expert intermediates 256): FP8 under TP2 loads block-aligned.
FP8_TP2_DIMS = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 256,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "v_head_dim": 32,
}

__all__ = [
    "DECODE_STEPS",
    "PROMPT_LENS",
    "all_model_steps",
    "collective_steps",
    "failing_steps",
    "model_steps",
    "rank_tensor",
    "row_parallel_bf16_steps",
]

PROMPT_LENS = [1, 9, 23, 4, 16]
DECODE_STEPS = 3


def _tokens(vocab: int) -> list[list[int]]:
    """Per sequence: prompt + DECODE_STEPS + 1 fixed tokens (ids past 2: not bos/eos/pad)."""
    g = torch.Generator().manual_seed(42)
    return [
        torch.randint(3, vocab, (n + DECODE_STEPS + 1,), generator=g).tolist() for n in PROMPT_LENS
    ]


def _main_steps(
    model: DeepseekForCausalLM, config: ModelConfig, tp: TensorParallel
) -> dict[str, torch.Tensor]:
    heads = tp.split(config.num_attention_heads, "num_attention_heads")  # this rank's
    seqs, cache = _tokens(config.vocab_size), PagedCache(config, num_heads=heads)
    prompts = [(i, s[:n]) for i, (s, n) in enumerate(zip(seqs, PROMPT_LENS, strict=True))]
    out = {"prefill": torch.cat(forward(model, cache, prompts))}
    decode = []
    for step in range(DECODE_STEPS):
        chunks = [
            (i, [s[n + step]]) for i, (s, n) in enumerate(zip(seqs, PROMPT_LENS, strict=True))
        ]
        decode += forward(model, cache, chunks, ForwardMode.DECODE)
    out["decode"] = torch.cat(decode)
    return out


def _mtp_steps(
    model: DeepseekForCausalLM, config: ModelConfig, tp: TensorParallel
) -> dict[str, torch.Tensor]:
    """As test_parity's MTP test: row i of the MTP gets token i+1 and the main model's hidden
    state at i; its attention is layer N of its own pool."""
    assert model.mtp is not None
    seqs = [s for s, n in zip(_tokens(config.vocab_size), PROMPT_LENS, strict=True) if n > 1]
    n_layers = config.num_hidden_layers
    heads = tp.split(config.num_attention_heads, "num_attention_heads")  # this rank's
    main_cache = PagedCache(config, num_heads=heads)
    mtp_cache = PagedCache(config, num_layers=n_layers + 1, num_heads=heads)
    logits = []
    for mode, (lo, hi) in ((ForwardMode.EXTEND, (0, -2)), (ForwardMode.DECODE, (-2, -1))):
        main = main_cache.batch([(i, s[lo:hi]) for i, s in enumerate(seqs)], mode)
        nxt = [(i, s[lo + 1 : hi + 1 if hi != -1 else None]) for i, s in enumerate(seqs)]
        mtp_batch = mtp_cache.batch(nxt, mode)
        hidden = model(main)
        out = model.mtp(mtp_batch.input_ids, mtp_batch.positions, hidden, mtp_batch)
        logits.append(model.mtp.compute_logits(out))
    return {"mtp": torch.cat(logits)}


@torch.no_grad()
def model_steps(
    tp: TensorParallel, path: str | Path, keep_fp8: bool | None = None
) -> dict[str, torch.Tensor]:
    """The checkpoint at `path` loaded with `tp` (fp32, CPU); its logits per phase."""
    config = ModelConfig.from_pretrained(path)
    model = load_model(config, path, tp=tp, keep_fp8=keep_fp8)
    out = _main_steps(model, config, tp)
    if model.mtp is not None:
        out |= _mtp_steps(model, config, tp)
    return out


def model_steps_tp1(path: str | Path, keep_fp8: bool | None = None) -> dict[str, torch.Tensor]:
    return model_steps(NO_TP, path, keep_fp8)


def collective_steps(tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Each collective on rank-dependent inputs (rank r's tensor is `rank_tensor(r)`), as this
    rank sees the results; the test recomputes them locally."""
    x = rank_tensor(tp.rank)
    bcast = rank_tensor(tp.rank)
    strided = rank_tensor(tp.rank).t()  # not contiguous: broadcast copies back through it
    return {
        "all_reduce": tp.all_reduce(x.clone()),
        "all_gather_0": tp.all_gather(x, 0),
        "all_gather_last": tp.all_gather(x, -1),
        "all_gather_row": tp.all_gather(x[:1], -1),  # one row: the gathered buffer, viewed
        "all_gather_mid": tp.all_gather(x.view(3, 2, 2), 1),
        "broadcast": tp.broadcast(bcast, src=1),
        "broadcast_strided": tp.broadcast(strided, src=0).clone(),
        "tree_all_reduce": tp.tree_all_reduce(x.clone()),
    }


def rank_tensor(rank: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1) + 0.5 * rank


def all_model_steps(
    tp: TensorParallel, cases: dict[str, tuple[str, bool | None]]
) -> dict[str, dict[str, torch.Tensor]]:
    """`model_steps` for every case (name -> (checkpoint path, keep_fp8)), in one process group:
    the processes start once for all of them."""
    return {name: model_steps(tp, path, keep_fp8) for name, (path, keep_fp8) in cases.items()}


def failing_steps(tp: TensorParallel) -> None:
    """Rank 1 raises; rank 0 waits for it in an all-reduce (the harness must not hang)."""
    if tp.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    tp.all_reduce(torch.ones(1))


def row_parallel_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """x [16, 2048] and W [512, 2048], bf16, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 2048, generator=gen).to(torch.bfloat16)
    w = (torch.randn(512, 2048, generator=gen) / 2048**0.5).to(torch.bfloat16)
    return x, w


def row_parallel_bf16_steps(tp: TensorParallel) -> dict[str, torch.Tensor]:
    """A bf16 RowParallelLinear on this rank's half of W's columns, with the partial sums
    reduced in fp32 (`fp32_reduce`, the default) and rounded by each rank first (off)."""
    from dataclasses import replace

    from mlaserve.model.layers.linear import RowParallelLinear

    x, w = row_parallel_weights()
    out = {}
    for name, fp32 in (("wide", True), ("narrow", False)):
        layer_tp = replace(tp, fp32_reduce=fp32)
        layer = RowParallelLinear(2048, 512, params_dtype=torch.bfloat16, tp=layer_tp)
        cols = 2048 // tp.size
        layer.weight.data.copy_(w[:, tp.rank * cols : (tp.rank + 1) * cols])
        out[name] = layer(x[:, tp.rank * cols : (tp.rank + 1) * cols])
    return out
