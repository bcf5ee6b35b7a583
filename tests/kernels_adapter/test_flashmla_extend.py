"""FlashMLA's EXTEND path (MHA form + torch's causal varlen FA2, `flash_varlen.py`) against the
latent form of the reference backend in fp32, over NaN-poisoned paged caches, at DeepSeek's
dims (512/64 latent, 128 nope + 64 rope query, 128 v, 16 heads, page 64).

Both sides get the same inputs: bf16 q / weights / new latent (as the model produces them), the
reference computes in fp32 from their exact values. Metric: max |err| / max |ref| per sequence.
The error is the kernel path's bf16 rounding of K, V, P and the output (and the fp8 cache's
stored values are what both sides read). Measured on an H100, 2026-11-22: see TOLERANCE.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mlaserve.kernels_adapter import flash_varlen, flashmla, get_backend_class
from mlaserve.kernels_adapter.absorbed_hit import takes_absorbed_hit
from mlaserve.kernels_adapter.flashmla import flashmla_available
from mlaserve.kernels_adapter.prefix_split import plan_split, split_prefix_attention
from tests.kernels_adapter.extend_case import Case, clone_pool, extend_setup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flashmla_available(), reason="needs an SM90 GPU and sgl-flash-mla"),
]

RANK, ROPE, HEADS, NOPE, V_DIM, PAGE = 512, 64, 16, 128, 128, 64
TOLERANCE = {torch.bfloat16: 2e-2, torch.float8_e4m3fn: 2e-2}
# The absorbed hit is decode's kernel: over an FP8 cache its query is e4m3 too (measured on an
# H200, 2026-11-29: 2.9e-2 to 4.1e-2), so it is held to the decode test's bounds.
ABSORBED_TOLERANCE = {torch.bfloat16: 2e-2, torch.float8_e4m3fn: 8e-2}

CASES = [
    Case([0, 0, 0], [100, 1, 300], PAGE, torch.bfloat16),  # fresh, with a 1-token prompt: FA2
    Case([0, 0, 0], [100, 2, 300], PAGE, torch.bfloat16),  # fresh prompts: cuDNN
    Case([64, 0, 700, 5], [37, 129, 1, 64], PAGE, torch.bfloat16),  # chunks over prefixes + decode
    Case([128], [64], PAGE, torch.bfloat16),  # prefix ending on a page boundary
    Case([0], [2048], PAGE, torch.bfloat16),  # one long fresh prompt
    Case([0, 0, 0], [100, 2, 300], PAGE, torch.float8_e4m3fn),
    Case([64, 0, 700, 5], [37, 129, 1, 64], PAGE, torch.float8_e4m3fn),
    Case([1000], [1048], PAGE, torch.float8_e4m3fn),
    # prefix-cache hits: a long prefix, a few new tokens; FA2 split over the prefix (prefix_split)
    Case([8192], [16], PAGE, torch.bfloat16),
    Case([4000], [64], PAGE, torch.float8_e4m3fn),
    Case([2048], [256], PAGE, torch.bfloat16),
]


def kv_b_views(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """w_uk [H, d_n, r] / w_uv [H, r, d_v] as the model splits kv_b_proj's weight (views)."""
    kv_b = torch.randn(HEADS * (NOPE + V_DIM), RANK, device=dev) / RANK**0.5
    w = kv_b.to(torch.bfloat16).view(HEADS, NOPE + V_DIM, RANK)
    return w[:, :NOPE], w[:, NOPE:].transpose(1, 2)


@dataclasses.dataclass
class Problem:
    """One case's inputs on the GPU, and the latent-form fp32 reference's output for them."""

    mc: object
    batch: object  # the EXTEND batch (reference backend until replaced)
    latent_pool: object  # the reference's twin of the pool, after its forward
    q: torch.Tensor  # [T, H, d_n + d_r] bf16
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    expected: torch.Tensor  # [T, H, d_v] fp32
    cu: list[int]


def problem(case: Case, dev: torch.device) -> Problem:
    mc, reference, batch, new_rows, cu = extend_setup(case, dev, dims=(RANK, ROPE, HEADS))
    bf16 = torch.bfloat16
    q = torch.randn(cu[-1], HEADS, NOPE + ROPE, device=dev).to(bf16)
    w_uk, w_uv = kv_b_views(dev)
    new_rows = new_rows.to(bf16)
    kv_c, k_pe = new_rows[:, :RANK], new_rows[:, RANK:]
    # Latent form, fp32, on a twin of the pool.
    latent_batch = dataclasses.replace(batch, kv_pool=clone_pool(batch.kv_pool))
    reference.prepare(latent_batch)
    q32 = q.float()
    q_latent = torch.einsum("thn,hnr->thr", q32[..., :NOPE], w_uk.float())
    o_latent = reference.forward(
        0, q_latent, q32[..., NOPE:], kv_c.float(), k_pe.float(), latent_batch
    )
    expected = torch.einsum("thr,hrv->thv", o_latent, w_uv.float())
    return Problem(mc, batch, latent_batch.kv_pool, q, kv_c, k_pe, w_uk, w_uv, expected, cu)


def check_against_reference(
    case: Case, p: Problem, got: torch.Tensor, batch, tolerance: dict = TOLERANCE
) -> float:
    """Shape, dtype, finiteness, the same pool bytes as the reference wrote, and the relative
    error per sequence under `tolerance` -> the worst error."""
    assert got.shape == (p.cu[-1], HEADS, V_DIM) and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    # Both paths stored the same new rows (bf16 latent -> the pool's dtype).
    assert torch.equal(
        batch.kv_pool.kv_buffers[0].view(torch.uint8), p.latent_pool.kv_buffers[0].view(torch.uint8)
    )
    worst = 0.0
    for b in range(len(case.q_lens)):
        ref, out = p.expected[p.cu[b] : p.cu[b + 1]], got[p.cu[b] : p.cu[b + 1]].float()
        err = float((out - ref).abs().max() / ref.abs().max())
        assert err < tolerance[case.kv_dtype], f"seq {b}: relative error {err:.2e}"
        worst = max(worst, err)
    return worst


def flashmla_backend(case: Case, mc, dev: torch.device):
    longest = max(4096, *(p + n for p, n in zip(case.prefix_lens, case.q_lens, strict=True)))
    return get_backend_class("flashmla")(mc, PAGE, case.kv_dtype, dev, len(case.q_lens), longest)


@pytest.mark.parametrize("kernel", ["auto", "fa2"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.prefix_lens}+{c.q_lens}-{c.kv_dtype}")
def test_flashmla_extend_matches_latent_reference(
    case: Case, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MHA form (`MLASERVE_ABSORBED_HIT=0`). auto: fresh batches take cuDNN
    (`cudnn_fresh.py`), the rest FA2; fa2: FA2 for all. A single sequence over a long prefix takes
    FA2 split over its prefix (`prefix_split.py`)."""
    if kernel == "fa2" and case.prefix_lens != [0] * len(case.prefix_lens):
        pytest.skip("batches with a prefix take FA2 under auto already")
    monkeypatch.setenv("MLASERVE_ABSORBED_HIT", "0")
    dev = torch.device("cuda")
    p = problem(case, dev)
    backend = flashmla_backend(case, p.mc, dev)
    if kernel == "fa2":
        backend._prefill_fresh.available = False
    batch = dataclasses.replace(p.batch, attn_backend=backend)
    backend.prepare(batch)
    splits = []

    def split_spy(*args, **kwargs):
        splits.append(args[5])  # the plan
        return split_prefix_attention(*args, **kwargs)

    monkeypatch.setattr(flash_varlen, "split_prefix_attention", split_spy)
    got = backend.forward_extend_mha(0, p.q, p.kv_c, p.k_pe, p.w_uk, p.w_uv, batch)
    seq_lens = tuple(a + n for a, n in zip(case.prefix_lens, case.q_lens, strict=True))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    plan = plan_split(tuple(case.q_lens), seq_lens, HEADS, sms)
    assert splits == ([plan] if plan is not None else []), (splits, plan)
    assert backend._prefill_fresh.refused == 0
    worst = check_against_reference(case, p, got, batch)
    print(
        f"flashmla extend {kernel} {case.prefix_lens}+{case.q_lens} {case.kv_dtype}: {worst:.2e}"
        f"{f', split into {plan.num_chunks} x {plan.chunk}' if plan else ''}"
    )


HITS = [
    Case([8192], [16], PAGE, torch.bfloat16),
    Case([8192], [16], PAGE, torch.float8_e4m3fn),
    Case([4000], [64], PAGE, torch.float8_e4m3fn),
    Case([2048], [128], PAGE, torch.bfloat16),  # MAX_NEW_TOKENS: 2048 query rows
    Case([1024], [1], PAGE, torch.float8_e4m3fn),  # MIN_PREFIX, one new token
    Case([1000], [48], PAGE, torch.bfloat16),  # under MIN_PREFIX: the MHA form
    Case([64, 0, 700, 5], [37, 129, 1, 64], PAGE, torch.bfloat16),  # several sequences: MHA
]


@pytest.mark.parametrize("case", HITS, ids=lambda c: f"{c.prefix_lens}+{c.q_lens}-{c.kv_dtype}")
def test_flashmla_absorbed_hit_matches_latent_reference(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`MLASERVE_ABSORBED_HIT` unset (on): a one-sequence hit (`takes_absorbed_hit`) is attended
    by FlashMLA's decode kernel in the absorbed form, the others as before; both match the
    reference."""
    monkeypatch.delenv("MLASERVE_ABSORBED_HIT", raising=False)
    dev = torch.device("cuda")
    p = problem(case, dev)
    backend = flashmla_backend(case, p.mc, dev)
    batch = dataclasses.replace(p.batch, attn_backend=backend)
    backend.prepare(batch)
    seq_lens = tuple(a + n for a, n in zip(case.prefix_lens, case.q_lens, strict=True))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    absorbed = takes_absorbed_hit(tuple(case.q_lens), seq_lens, HEADS, sms)
    assert isinstance(batch.attn_metadata, flashmla._AbsorbedHit) is absorbed
    assert absorbed == (len(case.q_lens) == 1 and case.prefix_lens[0] >= 1024)
    got = backend.forward_extend_mha(0, p.q, p.kv_c, p.k_pe, p.w_uk, p.w_uv, batch)
    worst = check_against_reference(
        case, p, got, batch, ABSORBED_TOLERANCE if absorbed else TOLERANCE
    )
    form = "absorbed" if absorbed else "mha"
    print(f"flashmla hit {form} {case.prefix_lens}+{case.q_lens} {case.kv_dtype}: {worst:.2e}")


def test_flashmla_latent_forward_refuses_extend() -> None:
    """EXTEND never reaches the decode kernel: the model hands it to forward_extend_mha."""
    dev = torch.device("cuda")
    mc, _, batch, _, _ = extend_setup(CASES[0], dev, dims=(RANK, ROPE, HEADS))
    backend = get_backend_class("flashmla")(mc, PAGE, torch.bfloat16, dev, 3, 4096)
    assert backend.mha_extend
    q = torch.randn(batch.num_tokens, HEADS, RANK + ROPE, device=dev, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="forward_extend_mha"):
        backend.forward(0, q[..., :RANK], q[..., RANK:], None, None, batch)
