"""The model built in the deterministic mode (`load_model(..., deterministic=True)` with the
`invariant` attention backend): a token's KV bytes and logits are bitwise independent of how its
prompt is chunked, of the other sequences in its forward, and of the phase computing it (EXTEND
prefill, DECODE, a VERIFY row).

Variants: `torch` (the CPU path: bf16 weights and cache, the kernels' torch forms), `interpreted` (the CUDA path's
Triton kernels under the interpreter, fp16 weights and an fp8 cache; tiny checkpoint) and, on
the GPU, the default model in bf16 with an fp8 cache. Caches are NaN-poisoned (`paged.py`).
"""

from __future__ import annotations

import functools

import pytest
import torch

from mlaserve.config import ModelConfig
from mlaserve.config.engine_config import default_model_path
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.kernels_adapter.invariant import InvariantBackend
from mlaserve.model import load_model
from tests.ops.cases import (
    HAS_CUDA,
    HAS_TRITON,
    gpu,
    row_invariant_interpreter_dot,
)

from .paged import PagedCache

VARIANTS = [
    pytest.param("torch", id="torch"),
    pytest.param(
        "interpreted",
        id="interpreted",
        marks=[
            pytest.mark.skipif(HAS_CUDA, reason="the GPU variant runs instead"),
            pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
        ],
    ),
    pytest.param("gpu", id="gpu-default-model", marks=gpu),
]
PROMPT = [5, 17, 300, 42, 9, 77, 120, 3, 64, 200, 11, 18, 250, 7, 99, 101, 6, 45, 333, 12, 8, 90]
NOISE = [[40 + i, 90 + 3 * i, 7 + i, 200 - i, 31, 64 + i, 5, 77 + i, 9, 13 + i] for i in range(5)]


class Setup:
    """A deterministic model and the way to make invariant caches for it."""

    def __init__(self, variant: str, path, monkeypatch: pytest.MonkeyPatch) -> None:
        """`monkeypatch` holds MLASERVE_FUSED_OPS=1 for the interpreted variant while the model
        and its caches are built (the kernels are chosen at construction)."""
        self.device = "cuda" if variant == "gpu" else "cpu"
        dtype = {"torch": torch.bfloat16, "interpreted": torch.float16, "gpu": torch.bfloat16}
        self.kv_dtype = torch.bfloat16 if variant == "torch" else torch.float8_e4m3fn
        if variant == "interpreted":  # the CUDA path's kernels, decided at construction
            monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
            row_invariant_interpreter_dot(monkeypatch)
        # the interpreter runs each program in numpy: a shorter prompt (still two 7-chunks)
        self.prompt = PROMPT[:12] if variant == "interpreted" else PROMPT
        self.config = ModelConfig.from_pretrained(path)
        self.model = load_model(
            self.config, path, dtype=dtype[variant], device=self.device, deterministic=True
        )

    def cache(self) -> PagedCache:
        cache = PagedCache(
            self.config, kv_dtype=self.kv_dtype, device=self.device, num_pages=96, page_size=4
        )  # its pool is built while MLASERVE_FUSED_OPS still holds (the fused KV write)
        cache.backend = InvariantBackend(
            self.config, 4, self.kv_dtype, torch.device(self.device), 64, 256, max_q_len=4
        )
        return cache


@pytest.fixture(scope="module", params=VARIANTS)
def setup(request, checkpoint):
    path = default_model_path() if request.param == "gpu" else checkpoint("v3_moe")
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield Setup(request.param, path, monkeypatch)


@torch.no_grad()
def _step(setup, cache, chunks, mode=ForwardMode.EXTEND) -> torch.Tensor:
    """One forward; -> logits [T, vocab] fp32 of every row."""
    batch = cache.batch(chunks, mode)
    return setup.model.compute_logits(setup.model(batch))


def _kv_bytes(cache: PagedCache, seq_id: int) -> list[torch.Tensor]:
    """The sequence's cache rows of every layer, as bytes (NaN-safe comparison)."""
    pages, n = cache.pages[seq_id], cache.lens[seq_id]
    slots = torch.tensor([pages[p // 4] * 4 + p % 4 for p in range(n)], device=cache.device)
    return [buf.view(-1, buf.shape[-1])[slots].view(torch.uint8) for buf in cache.pool.kv_buffers]


def _prefill(setup, cache, seq_id, tokens, chunk, noise: bool) -> torch.Tensor:
    """Prefill `tokens` in chunks of `chunk` (the first token alone then DECODE steps when
    chunk is 1), each with noise sequences' chunks before it in the batch (`noise`); -> the
    last row's logits."""
    logits = None
    for i, start in enumerate(range(0, len(tokens), chunk)):
        part = tokens[start : start + chunk]
        others = [(100 + j, NOISE[j][i % 10 : i % 10 + len(part)]) for j in range(2)]
        if chunk == 1 and i > 0:  # a decode step: one token per sequence
            others = [(100 + j, [NOISE[j][i % 10]]) for j in range(3 if i % 2 else 1)]
            mode = ForwardMode.DECODE
        else:
            mode = ForwardMode.EXTEND
        chunks = [*(others if noise else []), (seq_id, part)]
        logits = _step(setup, cache, chunks, mode)[-1]
    return logits


@functools.cache
def _noise_prefix() -> list[tuple[int, list[int]]]:
    return [(100 + j, NOISE[j][:3]) for j in range(3)]


def test_chunking_batching_and_phase_do_not_change_bits(setup):
    results = []
    prompt = setup.prompt
    for chunk, noise in ((len(prompt), False), (7, True), (1, True)):
        cache = setup.cache()
        if noise:  # other sequences already hold KV (their rows share the forwards below)
            _step(setup, cache, _noise_prefix())
        logits = _prefill(setup, cache, 0, prompt, chunk, noise)
        results.append((chunk, logits, _kv_bytes(cache, 0)))
    (_, ref_logits, ref_kv), *others = results
    assert not ref_logits.isnan().any()
    for chunk, logits, kv in others:
        assert torch.equal(logits, ref_logits), f"chunks of {chunk}: last-token logits moved"
        for layer, (got, want) in enumerate(zip(kv, ref_kv, strict=True)):
            assert torch.equal(got, want), f"chunks of {chunk}: layer {layer} KV bytes moved"


def test_verify_rows_equal_decode_rows(setup):
    draft = [21, 22, 23, 24]
    a, b = setup.cache(), setup.cache()
    for cache in (a, b):
        _step(setup, cache, [(0, PROMPT[:10]), (1, NOISE[0][:6])])
    # VERIFY: the 4 tokens at once (q_len 4), beside another sequence's 4
    verify = _step(setup, a, [(1, NOISE[1][:4]), (0, draft)], ForwardMode.VERIFY)[4:]
    # DECODE: one token a step, alone or with another sequence
    decode = []
    for i, token in enumerate(draft):
        chunks = [(0, [token])] if i % 2 else [(1, [NOISE[2][i]]), (0, [token])]
        decode.append(_step(setup, b, chunks, ForwardMode.DECODE)[-1])
    assert torch.equal(verify, torch.stack(decode))
    for got, want in zip(_kv_bytes(a, 0), _kv_bytes(b, 0), strict=True):
        assert torch.equal(got, want)
