"""Batched MoE (every implementation) vs a naive per-token loop, and routing vs transformers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mlaserve.config import ModelConfig
from mlaserve.model.layers.moe import DeepseekMoE
from mlaserve.ops.moe_partials import MoePartials, SortedExpertRows

HIDDEN, MOE_INTER, NUM_EXPERTS, TOP_K = 32, 16, 16, 4
GATINGS: dict[str, dict[str, Any]] = {
    "softmax_greedy": {
        "model_type": "deepseek_v2",
        "topk_method": "greedy",
        "routed_scaling_factor": 1.5,
    },
    "softmax_group_limited_greedy": {
        "model_type": "deepseek_v2",
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.5,
    },
    "sigmoid_noaux_tc": {
        "model_type": "deepseek_v3",
        "topk_method": "noaux_tc",
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    },
}


def make_config(gating: str) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "vocab_size": 64,
            "hidden_size": HIDDEN,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "kv_lora_rank": 16,
            "n_routed_experts": NUM_EXPERTS,
            "n_shared_experts": 1,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": MOE_INTER,
            **GATINGS[gating],
        }
    )


def make_moe(config: ModelConfig, dtype: torch.dtype = torch.float32) -> DeepseekMoE:
    moe = DeepseekMoE(config, params_dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        p.data.copy_(0.3 * torch.randn(p.shape, generator=g))
    return moe


def naive_route(
    logits: torch.Tensor, c: ModelConfig, bias: torch.Tensor | None
) -> dict[int, float]:
    """One token's DeepSeek routing written out directly: expert -> weight."""
    scores = logits.softmax(-1) if c.scoring_func == "softmax" else logits.sigmoid()
    per_group = NUM_EXPERTS // c.n_group
    choice = scores + bias if c.topk_method == "noaux_tc" else scores
    allowed = list(range(NUM_EXPERTS))
    if c.topk_method != "greedy":
        group_score = []
        for g in range(c.n_group):
            members = sorted(choice[g * per_group : (g + 1) * per_group].tolist(), reverse=True)
            group_score.append(sum(members[:2]) if c.topk_method == "noaux_tc" else members[0])
        groups = sorted(range(c.n_group), key=lambda g: -group_score[g])[: c.topk_group]
        allowed = [e for e in allowed if e // per_group in groups]
    chosen = sorted(allowed, key=lambda e: -choice[e].item())[:TOP_K]
    weights = {e: scores[e].item() for e in chosen}
    if c.norm_topk_prob:
        total = sum(weights.values()) + 1e-20
        weights = {e: w / total for e, w in weights.items()}
    return {e: w * c.routed_scaling_factor for e, w in weights.items()}


def naive_moe(moe: DeepseekMoE, x: torch.Tensor) -> torch.Tensor:
    c = moe.gate.config
    w13, w2 = moe.experts.gate_up_proj.float(), moe.experts.down_proj.float()
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        xt = x[t].float()
        for e, w in naive_route(moe.gate.weight @ xt, c, moe.gate.e_score_correction_bias).items():
            gate, up = (w13[e] @ xt).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
        out[t] += moe.shared_experts(x[t : t + 1])[0].float()
    return out


@pytest.mark.parametrize("impl", ["loop", "grouped_mm", "dense"])
@pytest.mark.parametrize("gating", list(GATINGS))
def test_batched_moe_matches_per_token_loop(gating: str, impl: str) -> None:
    moe = make_moe(make_config(gating))
    moe.experts.impl = impl
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = naive_moe(moe, x)
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gating", list(GATINGS))
def test_bf16_implementations_agree(gating: str) -> None:
    moe = make_moe(make_config(gating), torch.bfloat16)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    outs = {}
    for impl in ("loop", "grouped_mm", "dense"):
        moe.experts.impl = impl
        outs[impl] = moe(x).float()
    scale = outs["loop"].abs().max()
    for impl in ("grouped_mm", "dense"):
        assert (outs[impl] - outs["loop"]).abs().max() <= 2e-2 * scale, impl


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_tiny_batches(num_tokens: int) -> None:
    moe = make_moe(make_config("sigmoid_noaux_tc"))
    x = torch.randn(num_tokens, HIDDEN)
    for impl in ("loop", "grouped_mm", "dense"):
        moe.experts.impl = impl
        torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=1e-5, atol=1e-5)


def test_cpu_default_is_loop() -> None:
    moe = make_moe(make_config("softmax_greedy"))
    assert moe.experts.resolved_impl(torch.zeros(1, HIDDEN)) == "loop"


@pytest.mark.parametrize("gating", list(GATINGS))
def test_routing_matches_transformers(gating: str) -> None:
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = make_config(gating)
    moe = make_moe(config)
    kw = {
        "hidden_size": HIDDEN,
        "n_routed_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
    }
    if config.model_type == "deepseek_v3":
        ref = DeepseekV3TopkRouter(DeepseekV3Config(**kw, norm_topk_prob=config.norm_topk_prob))
        ref.e_score_correction_bias.copy_(moe.gate.e_score_correction_bias)
    else:
        ref = DeepseekV2TopkRouter(DeepseekV2Config(**kw, topk_method=config.topk_method))
    ref.weight.data.copy_(moe.gate.weight)
    x = torch.randn(50, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights, ids = moe.gate(x)
    _, ref_weights, ref_ids = ref(x)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    torch.testing.assert_close(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suites run the compiled kernels")
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 16, 17])
def test_decode_kernels_take_small_batches(num_tokens: int, monkeypatch) -> None:
    """With fused ops on (the interpreter here), batches of up to DECODE_MAX_TOKENS tokens run
    `ops/moe_decode.py` (routed + shared in three kernels), larger ones up to the grouped limit
    `ops/moe_grouped.py` (shared experts folded in), and both agree with the unfused layer (fp16,
    2e-2 of max |out|); past the limit the sorted grouped-GEMM path runs."""
    pytest.importorskip("triton")
    from mlaserve.model.layers import moe as moe_module

    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    monkeypatch.setenv("MLASERVE_MOE_GROUPED_MAX_TOKENS", "16")
    layer = make_moe(make_config("sigmoid_noaux_tc"), torch.float16)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(3)).half()
    want = layer(x).float()
    calls = []
    real = moe_module.DeepseekMoE.process_weights_after_loading
    real(layer)
    assert layer.decode_weights is not None and layer.decode_weights.num_shared == 1
    assert layer.grouped_max_tokens == 16
    decode, grouped = layer._moe_decode, layer._moe_grouped
    layer._moe_decode = lambda *a, **kw: calls.append("decode") or decode(*a, **kw)
    layer._moe_grouped = lambda *a, **kw: calls.append("grouped") or grouped(*a, **kw)
    got = layer(x).float()
    assert layer.decode_max_tokens == moe_module.DECODE_MAX_TOKENS  # small experts
    if num_tokens <= layer.decode_max_tokens:
        assert calls == ["decode"]
    else:
        assert calls == (["grouped"] if num_tokens <= 16 else [])
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    # Uncombined (the decoder layer's call): the decode and grouped kernels return the per-slot
    # partials, the sorted path its expert rows; either's combine gives the combined call's bits.
    calls.clear()
    partial = layer(x, combine=False)
    assert isinstance(partial, MoePartials if calls else SortedExpertRows)
    assert torch.equal(partial.total().float(), got)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suites run the compiled kernels")
def test_bf16_layers_bound_by_their_expert_bytes_switch_to_grouped_kernels_sooner(
    monkeypatch,
) -> None:
    """Experts of >= BYTES_BOUND_EXPERT_BYTES (gate_up + down) in a 16-bit dtype take the grouped
    kernels past DECODE_MAX_TOKENS_BYTES_BOUND tokens; small ones keep the decode kernels to
    DECODE_MAX_TOKENS (their layer is launch latency, and the decode kernels launch once less)."""
    pytest.importorskip("triton")
    from mlaserve.model.layers import moe as moe_module

    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    config = make_config("softmax_greedy")
    big = dataclasses.replace(config, hidden_size=512, moe_intermediate_size=512)
    for cfg, want in (
        (config, moe_module.DECODE_MAX_TOKENS),
        (big, moe_module.DECODE_MAX_TOKENS_BYTES_BOUND),
    ):
        layer = DeepseekMoE(cfg, params_dtype=torch.float16)
        expert = layer.experts.gate_up_proj[0].numel() + layer.experts.down_proj[0].numel()
        assert (2 * expert >= moe_module.BYTES_BOUND_EXPERT_BYTES) == (cfg is big)
        layer.process_weights_after_loading()
        assert layer.decode_max_tokens == want
    monkeypatch.setenv("MLASERVE_MOE_DECODE_MAX_TOKENS", "5")  # the override wins
    layer.process_weights_after_loading()
    assert layer.decode_max_tokens == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suites run the compiled kernels")
def test_fp8_layers_wider_than_one_run_take_the_long_k_tiles_at_one_or_two_tokens(
    monkeypatch,
) -> None:
    """FP8 experts wider than moe_decode's FP8_RUN (V3's 7168) take the decode kernels' long-K
    tiles up to WIDE_FP8_DECODE_MAX_TOKENS tokens (twice that for a rank's expert of at most
    WIDE_NARROW_INTER), select outside the kernel, and the grouped kernels serve past that; at
    V2-Lite's 2048 the decode kernels keep DECODE_MAX_TOKENS, their 2048-column runs and the
    selection inside. The deterministic tiles (`leaves`) stay 128 columns wide. The override
    still wins."""
    from mlaserve.ops.moe_decode import FP8_RUN, DecodeTiles, decode_tiles

    pytest.importorskip("triton")
    from mlaserve.config import QuantizationConfig
    from mlaserve.model.layers import moe as moe_module

    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    config = make_config("softmax_greedy")
    limit, wide_max = FP8_RUN, moe_module.WIDE_FP8_DECODE_MAX_TOKENS
    narrow = moe_module.WIDE_NARROW_INTER
    cases = (  # hidden, expert width, decode_max_tokens, selection inside, default tiles
        (limit, 128, moe_module.DECODE_MAX_TOKENS, True, DecodeTiles((8, 8), (2048, 128), 4)),
        (7168, narrow, 2 * wide_max, False, DecodeTiles((4, 16), (8192, 512), 4)),
        (7168, 2048, wide_max, False, DecodeTiles((4, 16), (8192, 1024), 4)),
    )
    for hidden, inter, want, inside, want_tiles in cases:
        cfg = dataclasses.replace(config, hidden_size=hidden, moe_intermediate_size=inter)
        layer = DeepseekMoE(cfg, params_dtype=torch.bfloat16, quant=QuantizationConfig())
        assert layer.experts.gate_up_proj.dtype == torch.float8_e4m3fn
        layer.process_weights_after_loading()
        assert layer.decode_max_tokens == want
        assert (layer.select_in_kernel > 0) == inside
        assert layer.grouped_max_tokens == moe_module.GROUPED_MAX_TOKENS_FP8
        assert layer.decode_weights is not None
        assert decode_tiles(layer.decode_weights, 1) == want_tiles
        det = decode_tiles(layer.decode_weights, 2, leaves=1)
        assert (det == DecodeTiles((16, 16), (128, 128), 4)) == (hidden > limit), det
    monkeypatch.setenv("MLASERVE_MOE_DECODE_MAX_TOKENS", "4")
    layer.process_weights_after_loading()
    assert layer.decode_max_tokens == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suites run the compiled kernels")
def test_grouped_limit_past_the_kernels_reach_is_a_clear_error(monkeypatch) -> None:
    """MLASERVE_MOE_GROUPED_MAX_TOKENS past MAX_PAIRS / slots is refused at start, naming the
    switch (a million tokens ended in an illegal memory access on an H200)."""
    pytest.importorskip("triton")
    from mlaserve.switches import SwitchError

    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    monkeypatch.setenv("MLASERVE_MOE_GROUPED_MAX_TOKENS", "1000000")
    layer = make_moe(make_config("softmax_greedy"), torch.float16)
    with pytest.raises(SwitchError, match="MLASERVE_MOE_GROUPED_MAX_TOKENS=1000000"):
        layer.process_weights_after_loading()


def test_decode_kernels_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    monkeypatch.setenv("MLASERVE_MOE_DECODE_MAX_TOKENS", "0")
    monkeypatch.setenv("MLASERVE_MOE_GROUPED_MAX_TOKENS", "0")
    layer = make_moe(make_config("softmax_greedy"), torch.float16)
    layer.process_weights_after_loading()
    assert layer.decode_weights is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [600, 2048])
def test_shared_experts_on_the_side_stream_give_the_in_line_bits(num_tokens, monkeypatch) -> None:
    """Prefill-sized batches run the shared experts on a side stream beside the routed ones
    (`_side_stream`): the same kernels, so the same bits as in line, eagerly and replayed from
    a CUDA graph captured with the fork and join (fresh inputs each replay)."""
    from mlaserve.model.layers import moe as moe_module

    config = make_config("sigmoid_noaux_tc")
    layer = make_moe(config, torch.bfloat16).to("cuda")
    layer.process_weights_after_loading()
    x = torch.empty(num_tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")

    def in_line(inp: torch.Tensor) -> torch.Tensor:
        monkeypatch.setenv("MLASERVE_SHARED_OVERLAP", "0")
        moe_module._side_stream.cache_clear()
        try:
            return layer(inp)
        finally:
            monkeypatch.delenv("MLASERVE_SHARED_OVERLAP")
            moe_module._side_stream.cache_clear()

    assert moe_module._side_stream(x.device) is not None
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x.copy_(torch.randn(num_tokens, HIDDEN, generator=gen, device="cuda"))
    assert torch.equal(layer(x), in_line(x))  # eager, and the side path's warm-up
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        graph.capture_begin()
        out = layer(x)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        x.copy_(torch.randn(num_tokens, HIDDEN, generator=gen, device="cuda"))
        graph.replay()
        assert torch.equal(out, in_line(x))


@pytest.mark.parametrize("num_tokens,side", [(8, False), (64, False), (65, True)])
def test_the_side_stream_only_past_the_split_kernels_sizes(num_tokens, side, monkeypatch) -> None:
    """The shared experts go to the side stream only past `W8A16_MAX_M` tokens, so no FP8
    decode GEMM (whose K split shares the device's arrival counters, `ops/split_counters.py`)
    runs there beside one on the main stream."""
    from mlaserve.model.layers import moe as moe_module

    asked = []
    monkeypatch.setattr(moe_module, "_side_stream", lambda device: asked.append(device))
    layer = make_moe(make_config("sigmoid_noaux_tc"), torch.float32)
    layer(torch.randn(num_tokens, HIDDEN))
    assert bool(asked) is side
