"""Programmatic dependent launch (`mlaserve/ops/pdl.py`): when it is used, and that a chain of
every PDL kernel, captured in a CUDA graph and replayed on fresh inputs, gives the same bits as
the same chain run eagerly without PDL.

A kernel that read its predecessor's output before `griddepcontrol.wait`, or wrote before it,
would race: the replay would then differ from the eager run on some replays. The chain below is
one decode layer's kernels back to back (norm, GEMV or, with FP8 at 8 tokens, the W8A16 wide
kernel split over K, latent norm + rope + FP8 KV write, q prep or W_UK's GEMV writing the joined
query, router logits, routing, the MoE decode or grouped kernels, the partials' norm), two layers
deep, at V2-Lite's MoE shape, so each consumer starts while its producer's last programs run.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.ops.cases import HAS_CUDA, HAS_TRITON, gpu
from tests.ops.moe_cases import SHAPES, make_weights

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


@pytest.fixture
def pdl_env():
    """Set MLASERVE_PDL for one test; the launch decision is cached per device, so clear it."""
    from mlaserve.ops.pdl import pdl_launch

    old = os.environ.get("MLASERVE_PDL")

    def set_flag(value: str | None) -> None:
        if value is None:
            os.environ.pop("MLASERVE_PDL", None)
        else:
            os.environ["MLASERVE_PDL"] = value
        pdl_launch.cache_clear()

    yield set_flag
    set_flag(old)


def test_pdl_only_on_cuda_sm90_and_not_when_switched_off(pdl_env):
    from mlaserve.ops.pdl import pdl_launch

    pdl_env(None)
    assert pdl_launch(torch.device("cpu")) is False
    if HAS_CUDA:
        sm90 = torch.cuda.get_device_capability()[0] >= 9
        assert pdl_launch(torch.device("cuda")) is sm90
    pdl_env("0")
    assert pdl_launch(torch.device("cpu")) is False
    if HAS_CUDA:
        assert pdl_launch(torch.device("cuda")) is False


class _Layer:
    """Random weights of one decode layer's kernels: hidden 2048, 16 heads, latent 512 + 64,
    V2-Lite's MoE (64 experts, top-6, 2 shared slices of 1408)."""

    def __init__(self, fp8: bool, gen: torch.Generator) -> None:
        from mlaserve.ops.moe_decode import MoeDecodeWeights

        dev, bf16 = "cuda", torch.bfloat16
        self.hidden, self.heads = 2048, 16
        self.norm1 = (1 + 0.1 * torch.randn(2048, generator=gen, device=dev)).to(bf16)
        self.norm2 = (1 + 0.1 * torch.randn(2048, generator=gen, device=dev)).to(bf16)
        self.latent_norm = (1 + 0.1 * torch.randn(512, generator=gen, device=dev)).to(bf16)
        # q (16 x 64 rope dims) | kv_c (512) | k_pe (64)
        self.w_a = (torch.randn(16 * 64 + 576, 2048, generator=gen, device=dev) / 45).to(bf16)
        self.w_a_fp8 = None
        if fp8:  # 3-16 tokens take the W8A16 wide kernel, split over K as V3's q|kv_a
            from mlaserve.ops.fp8_quant import quantize_weight_block

            self.w_a_fp8 = quantize_weight_block(self.w_a)
        self.gate = torch.randn(64, 2048, generator=gen, device=dev) / 45
        self.w_uk = (torch.randn(16, 128, 512, generator=gen, device=dev) / 11).to(bf16)
        kernel, _, scales = make_weights(SHAPES["v2lite"], fp8, bf16, dev, gen)
        self.moe = MoeDecodeWeights(**kernel, **scales)


_V2LITE_ROUTER = dict(
    top_k=6, scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
    norm_topk_prob=False, routed_scaling_factor=1.0,
)  # fmt: skip


def _layer_chain(x, res, layer, cache, slots, cos, sin, grouped, joined):
    """One layer's PDL kernels back to back; returns (x, residual) for the next layer. `joined`:
    the decode prologue (W_UK's GEMV with the norm's programs) writes the joined query, instead
    of the norm kernel and the q preparation."""
    from mlaserve.ops.gemv import gemv
    from mlaserve.ops.mla_decode_prologue import mla_decode_prologue
    from mlaserve.ops.mla_norm_rope import mla_norm_rope
    from mlaserve.ops.moe_decode import moe_decode
    from mlaserve.ops.moe_grouped import moe_grouped
    from mlaserve.ops.q_prep import prepare_q
    from mlaserve.ops.rms_norm import add_partials_rms_norm, add_rms_norm
    from mlaserve.ops.router_logits import router_logits
    from mlaserve.ops.routing import fused_select_experts, plan_routing
    from mlaserve.ops.w8a16_gemm import W8A16_WIDE_MAX_M, w8a16_block_fp8_matmul_triton

    t = x.shape[0]
    h, res = add_rms_norm(x, res, layer.norm1, 1e-6)
    if t <= 2:
        a = gemv(h, layer.w_a)
    elif layer.w_a_fp8 is not None and t <= W8A16_WIDE_MAX_M:
        a = w8a16_block_fp8_matmul_triton(h, *layer.w_a_fp8, split=2)
    else:
        a = h @ layer.w_a.T
    q_pe = a[:, : 16 * 64].view(t, 16, 64)
    kv_c, k_pe = a[:, 16 * 64 : 16 * 64 + 512], a[:, 16 * 64 + 512 :]
    if joined and t <= 8:  # as the model: the decode prologue writes the joined query
        q = torch.empty(t, 16, 576, dtype=torch.bfloat16, device="cuda")
        q_nope = q_pe.repeat(1, 1, 2)  # a stand-in for the q projection's [T, 16, 128]
        mla_decode_prologue(
            kv_c, k_pe, q_nope, q_pe, layer.latent_norm, 1e-6, cos, sin, False, layer.w_uk,
            cache, slots, 1.0, joined=q,
        )  # fmt: skip
    else:
        _, _, q_pe = mla_norm_rope(
            kv_c, k_pe, q_pe, layer.latent_norm, 1e-6, cos, sin, False,
            kv_cache=cache, slot_mapping=slots,
        )  # fmt: skip
        q_nope = q_pe.repeat(1, 1, 8)  # a stand-in for the absorbed query [T, 16, 512]
        q = prepare_q(q_nope, q_pe, torch.bfloat16)  # [T, 16, 576]
    h = h + q.view(t, -1)[:, : layer.hidden]  # the next norm reads both producers
    h, res = add_rms_norm(h, res, layer.norm2, 1e-6)
    logits = router_logits(h, layer.gate)
    if not grouped and t <= 4:  # as the model: the selection inside moe_decode's first kernel
        plan = plan_routing(logits, **_V2LITE_ROUTER)
        parts = moe_decode(h, plan.weights, plan.ids, layer.moe, combine=False, routing=plan)
    else:
        wts, ids = fused_select_experts(logits, **_V2LITE_ROUTER)
        moe = moe_grouped if grouped else moe_decode
        parts = moe(h, wts, ids, layer.moe, combine=False)
    return add_partials_rms_norm(parts.parts, res, layer.norm1, 1e-6)


@pytest.mark.parametrize("joined", [False, True], ids=["q_prep", "joined"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
@gpu[0]
@gpu[1]
def test_graph_with_pdl_matches_eager_without(pdl_env, tokens, fp8, joined):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs an SM90+ GPU")
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    layers = [_Layer(fp8, gen) for _ in range(2)]
    grouped = tokens > 8  # the decode kernels take 1-8 tokens, the grouped ones 9-256
    num_slots = 4096
    x = torch.empty(tokens, 2048, dtype=torch.bfloat16, device="cuda")
    res = torch.empty_like(x)
    slots = torch.empty(tokens, dtype=torch.int64, device="cuda")
    angles = torch.empty(tokens, 32, device="cuda")

    def run(cache):
        cos, sin = angles.cos(), angles.sin()
        y, r = x, res
        for i, layer in enumerate(layers):
            y, r = _layer_chain(y, r, layer, cache[i], slots, cos, sin, grouped, joined)
        return y, r

    def fill(step):
        g = torch.Generator(device="cuda").manual_seed(1000 + step)
        x.copy_(torch.randn(tokens, 2048, generator=g, device="cuda"))
        res.copy_(torch.randn(tokens, 2048, generator=g, device="cuda"))
        slots.copy_(torch.randperm(num_slots, generator=g, device="cuda")[:tokens])
        angles.copy_(torch.rand(tokens, 32, generator=g, device="cuda") * 6)

    def new_cache():
        return torch.full((2, num_slots, 576), float("nan"), device="cuda").to(torch.float8_e4m3fn)

    pdl_env("1")
    fill(0)
    cache_graph = new_cache()
    run(cache_graph)  # compile the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(cache_graph)
    pdl_env("0")
    cache_eager = new_cache()
    for step in range(12):
        fill(step)
        graph.replay()
        want = run(cache_eager)
        torch.cuda.synchronize()
        for got, ref in zip(out, want):
            assert torch.equal(got, ref), f"step {step}: PDL graph replay differs from eager"
        assert torch.equal(cache_graph.view(torch.uint8), cache_eager.view(torch.uint8))


_HELD = r"""
from mlaserve.ops import head_gemv as G
from mlaserve.ops import mla_decode_prologue as P
from mlaserve.ops import q_prep as Q

qp = dict(R=512, DR=64, BLOCK_R=512, BLOCK_DR=64, FP8=True, FP8_MAX=448.0, PDL=True)
sig = signature(Q._prepare_q_kernel,
                {"q_nope_ptr": "*bf16", "q_pe_ptr": "*bf16", "out_ptr": "*fp8e4nv"},
                constexprs=qp)
cases.append(("prepare_q", Q._prepare_q_kernel, sig, qp))
hg = dict(K=128, N=512, DR=0, BLOCK_M=1, BLOCK_N=32, BLOCK_K=128, BLOCK_DR=1, TAIL=False,
          ROPE_TAIL=False, INTERLEAVED=False, FP8_MAX=448.0, PDL=True)
ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "t_ptr": "*bf16",
        "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
cases.append(("head_gemv", G._head_gemv_kernel,
              signature(G._head_gemv_kernel, ptrs, constexprs=hg), hg))
for out in ("bf16", "fp8e4nv"):  # the joined query, in either FlashMLA q dtype
    joined = dict(hg, DR=64, BLOCK_DR=64, TAIL=True)
    sig = signature(G._head_gemv_kernel, dict(ptrs, y_ptr="*" + out), constexprs=joined)
    cases.append((f"head_gemv_joined_{out}", G._head_gemv_kernel, sig, joined))
# the decode prologue (norm, RoPEs, KV write and W_UK in one launch), plain and joined
norm = dict(R=512, HALF=32, BLOCK_R=512, BLOCK_HALF=32, BLOCK_H=16, WRITE=True, FP8=True)
pro = dict(hg, **norm, COL_BLOCKS=16)
bf = {n: "*bf16" for n in ("kv_c_ptr", "k_pe_ptr", "q_pe_ptr", "gamma_ptr", "kv_c_out_ptr",
                           "k_pe_out_ptr", "q_pe_out_ptr")}
pp = dict(ptrs, **bf, cache_ptr="*fp8e4nv", slot_ptr="*i64")
sig = signature(P._prologue_kernel, pp, floats=("kv_scale", "eps"), constexprs=pro)
cases.append(("prologue", P._prologue_kernel, sig, pro))
for out in ("bf16", "fp8e4nv"):
    joined = dict(pro, DR=64, BLOCK_DR=64, TAIL=True, ROPE_TAIL=True)
    sig = signature(P._prologue_kernel, dict(pp, y_ptr="*" + out), floats=("kv_scale", "eps"),
                    constexprs=joined)
    cases.append((f"prologue_joined_{out}", P._prologue_kernel, sig, joined))
"""


def test_the_kernel_before_flashmla_holds_its_dependents() -> None:
    """FlashMLA's dense SM90 decode kernel is launched with PDL but never waits for its
    predecessor (`ops/pdl.py`), so the kernel right before it, the q preparation or W_UK's GEMV
    writing the joined query (`tail`, alone or in the decode prologue, whose norm programs
    write the KV rows FlashMLA reads), must not let it launch early: compiled for SM90 with
    PDL, it waits (`griddepcontrol.wait`) and has no early trigger
    (`griddepcontrol.launch_dependents`). The plain GEMV keeps the usual contract and has both:
    the check reads the instructions, it does not pass on an empty PTX. Compiled ahead of time
    (no GPU needed)."""
    from tests.aot_compile import ptx_for_sm90

    ptx = ptx_for_sm90(_HELD)
    held = ("prepare_q", "head_gemv_joined_bf16", "head_gemv_joined_fp8e4nv")
    for kernel in (*held, "prologue_joined_bf16", "prologue_joined_fp8e4nv"):
        assert "griddepcontrol.wait" in ptx[kernel], kernel
        assert "griddepcontrol.launch_dependents" not in ptx[kernel], kernel
    for kernel in ("head_gemv", "prologue"):
        assert "griddepcontrol.wait" in ptx[kernel], kernel
        assert "griddepcontrol.launch_dependents" in ptx[kernel], kernel


_EARLY = r"""
from mlaserve.ops import mla_decode as A
from mlaserve.ops import moe_decode as D

ptrs = {"ids_ptr": "*i64", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp8e4nv", "s_ptr": "*fp32",
        "ss_ptr": "*fp32", "wts_ptr": "*fp32", "logits_ptr": "*fp32", "bias_ptr": "*fp32",
        "h_ptr": "*bf16", "part_ptr": "*fp32"}
sel = dict(SPLITS=1, G=1, PG=64, TOPK_GROUP=1, BLOCK_G=1, BLOCK_PG=64, BLOCK_K_SEL=8,
           METHOD=0, SIGMOID=False, HAS_BIAS=False, NORM=False, PDL=True)
for route in (False, True):
    dn = dict(H=2048, INTER=1408, K=6, S=2, HAS_SCALE=True, UNIFORM_SCALE=True, BLOCK_N=8,
              BLOCK_K=2048, CHUNK=1408, TREE=False, ROUTE=route, **sel)
    sig = signature(D._down_kernel, ptrs, floats=("scaling",), constexprs=dn)
    cases.append((f"moe_down_route_{route}", D._down_kernel, sig, dn))
sp = dict(H=16, R=512, DR=64, PAGE=64, BLOCK_M=16, BLOCK_N=16, BLOCK_R=512, BLOCK_D=512,
          BLOCK_DR=64, MIN_CHUNK=16, FP8=True, DIRECT=False, DOT_PREC="ieee", WHILE_LOOP=False,
          PDL=True)
sig = signature(A._mla_split_kernel, {"q_nope_ptr": "*bf16", "q_pe_ptr": "*bf16",
                "kv_cache_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32", "partial_ptr": "*fp32", "lse_ptr": "*fp32",
                "out_ptr": "*bf16"},
                floats=("qk_scale",), constexprs=sp)
cases.append(("mla_split", A._mla_split_kernel, sig, sp))
"""


def test_kernels_read_constants_and_older_outputs_before_their_wait() -> None:
    """The MoE decode's down kernel loads its selection and weight tile, and the split-KV
    attention its lengths, page ids and k_scale, before `griddepcontrol.wait` (what the PTX
    says, compiled for SM90 with PDL), so under PDL those loads overlap the previous kernel;
    each still waits before anything else (the graph-vs-eager test above checks the bits)."""
    from tests.aot_compile import ptx_for_sm90

    for name, ptx in ptx_for_sm90(_EARLY).items():
        head, wait, tail = ptx.partition("griddepcontrol.wait")
        assert wait, name
        assert "ld.global" in head, f"{name}: nothing loaded before the wait"
        assert "ld.global" in tail, f"{name}: nothing loaded after the wait"
