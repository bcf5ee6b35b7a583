"""The decode MoE kernels vs an fp32 reference of routed + shared experts, bf16 and FP8 weights.

Every expert no token selects is NaN-poisoned, so a kernel that reads one fails. Tolerance:
max |err| <= 2e-2 * max |ref| (bf16 rounds gate/up, h and each expert's output, as the unfused
path does; FP8 weights are compared with their dequantised values, so only the same roundings
remain); the mean error is also bounded at 3e-3 of max |ref|.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case, model_dtype
from tests.ops.moe_cases import (
    SHAPES,
    assert_close_to_reference,
    layer_weights,
    make_weights,
    poison_unused,
    reference,
)

# (tokens, shape, fp8, (block_n, block_k, warps)): the FP8 scales' two paths (one scale per K block
# applied to x's slice when block_n divides 128, per row on the weights otherwise) and wide steps
TILE_CASES = [
    cpu_case(2, "default", True, ((8, 8), (256, 128), 4)),
    cpu_case(1, "default", True, ((256, 256), (64, 64), 4)),
    cpu_case(2, "tiny", False, ((4, 4), (256, 128), 4)),
    gpu_case(1, "v2lite", True, ((16, 16), (128, 128), 8)),
    gpu_case(4, "v2lite", True, ((256, 256), (128, 64), 4)),
    gpu_case(3, "v3_slice", True, ((4, 8), (2048, 1024), 4)),
    # the wide layers' long-K tiles: the whole hidden dim in one masked step (7168 of 8192)
    cpu_case(1, "default", True, ((4, 16), (512, 128), 4)),
    gpu_case(2, "v3_slice", True, ((4, 16), (8192, 512), 4)),
    gpu_case(2, "v2lite", False, ((8, 8), (512, 512), 4)),
]
CASES = (
    [
        gpu_case(t, shape, fp8, None)
        for t in (1, 2, 4, 8, 16)
        for shape in ("v2lite", "v3_slice", "default")
        for fp8 in (False, True)
    ]
    + [
        cpu_case(2, "tiny", False, None),
        cpu_case(3, "tiny_noshared", False, None),
        cpu_case(2, "tiny_noshared", True, None),
        cpu_case(1, "default", True, None),
        cpu_case(2, "tiny_fp8", True, None),  # no leaves: no 128-block rule on I
    ]
    + TILE_CASES
)


def _inputs(shape, fp8, num_tokens, device, seed):
    """(kernel weights, reference weights, scales, x, ids, routing weights, the kernel's
    `MoeDecodeWeights`) of one case, the experts no token picks NaN-poisoned (seeded by
    `seed` + E)."""
    num_e, top_k, _, hidden, _ = shape
    dtype = model_dtype(device)
    gen = torch.Generator(device=device).manual_seed(seed + num_e)
    kernel, ref, scales = make_weights(shape, fp8, dtype, device, gen)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    ids = torch.stack(
        [torch.randperm(num_e, generator=gen, device=device)[:top_k] for _ in range(num_tokens)]
    )
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.1
    poison_unused(kernel, scales, ids, num_e, fp8)
    return kernel, ref, scales, x, ids, weights, layer_weights(kernel, scales)


@pytest.mark.parametrize("num_tokens,shape_name,fp8,tiles,device", CASES)
def test_moe_decode_matches_reference(num_tokens, shape_name, fp8, tiles, device):
    from mlaserve.ops.moe_decode import moe_decode

    shape = SHAPES[shape_name]
    num_s, hidden = shape[2], shape[3]
    dtype = model_dtype(device)
    _, ref, _, x, ids, weights, layer = _inputs(shape, fp8, num_tokens, device, num_tokens * 7)
    assert layer.num_shared == num_s
    if tiles is None:  # decode_tiles' defaults
        got = moe_decode(x, weights, ids, layer)
    else:
        block_n, block_k, warps = tiles
        got = moe_decode(x, weights, ids, layer, block_n=block_n, block_k=block_k, num_warps=warps)
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    assert_close_to_reference(got, reference(x, weights, ids, ref, num_s))


def test_moe_decode_weights_refuse_mismatched_shapes():
    from mlaserve.ops.moe_decode import MoeDecodeWeights

    w13, w2 = torch.zeros(4, 2 * 32, 64), torch.zeros(4, 64, 32)
    with pytest.raises(ValueError, match="w2"):
        MoeDecodeWeights(w13, torch.zeros(4, 64, 16))
    with pytest.raises(ValueError, match="slices"):
        MoeDecodeWeights(w13, w2, torch.zeros(2 * 48, 64), torch.zeros(64, 48))
    assert MoeDecodeWeights(w13, w2, torch.zeros(2 * 64, 64), torch.zeros(64, 64)).num_shared == 2


def test_moe_decode_refuses_wide_steps_with_per_row_scales():
    from mlaserve.ops.moe_decode import moe_decode

    gen = torch.Generator().manual_seed(0)
    kernel, _, scales = make_weights(SHAPES["default"], True, torch.float32, "cpu", gen)
    x = torch.zeros(1, SHAPES["default"][3])
    ids, weights = torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2)
    with pytest.raises(ValueError, match="block_k"):
        moe_decode(
            x, weights, ids, layer_weights(kernel, scales), block_n=(256, 8), block_k=(256, 64)
        )


# (tokens, shape, fp8, routing: (scoring, topk_method, n_group, topk_group, norm, scaling, bias))
V2_ROUTING = ("softmax", "greedy", 1, 1, False, 1.0, False)
V3_ROUTING = ("sigmoid", "noaux_tc", 4, 2, True, 2.5, True)
ROUTING_CASES = [
    gpu_case(t, shape, fp8, r)
    for t in (1, 2, 8)
    for shape, r in (("v2lite", V2_ROUTING), ("v3_slice", V3_ROUTING))
    for fp8 in (False, True)
] + [
    cpu_case(2, "tiny", False, V2_ROUTING),
    cpu_case(1, "default", True, ("softmax", "group_limited_greedy", 2, 1, True, 1.0, False)),
    cpu_case(3, "tiny_noshared", False, (*V3_ROUTING[:2], 1, 1, *V3_ROUTING[4:])),
]


@pytest.mark.parametrize("num_tokens,shape_name,fp8,routing,device", ROUTING_CASES)
def test_selection_inside_the_first_kernel_equals_selecting_first(
    num_tokens, shape_name, fp8, routing, device
):
    """`routing=`: the gate_up kernel selects the experts from the router logits itself; the
    weights and ids it fills and the layer's output have the bits of `fused_select_experts`
    followed by `moe_decode` (the same selection code, the same kernels after it)."""
    from mlaserve.ops.moe_decode import moe_decode
    from mlaserve.ops.routing import fused_select_experts, plan_routing

    shape = SHAPES[shape_name]
    num_e, top_k, _, hidden, _ = shape
    dtype = model_dtype(device)
    gen = torch.Generator(device=device).manual_seed(num_tokens * 11 + num_e)
    kernel, _, scales = make_weights(shape, fp8, dtype, device, gen)
    layer = layer_weights(kernel, scales)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(num_tokens, num_e, generator=gen, device=device) * 2
    scoring, method, groups, topk_group, norm, scaling, bias = routing
    kw = {
        "top_k": top_k,
        "scoring_func": scoring,
        "topk_method": method,
        "n_group": groups,
        "topk_group": topk_group,
        "norm_topk_prob": norm,
        "routed_scaling_factor": scaling,
        "correction_bias": torch.rand(num_e, generator=gen, device=device) if bias else None,
    }
    want_w, want_ids = fused_select_experts(logits, **kw)
    want = moe_decode(x, want_w, want_ids, layer)
    plan = plan_routing(logits, **kw)
    got = moe_decode(x, plan.weights, plan.ids, layer, routing=plan)
    assert torch.equal(plan.ids, want_ids)
    assert torch.equal(plan.weights, want_w)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="its own weights and ids"):
        moe_decode(x, want_w, want_ids, layer, routing=plan)


# The deterministic mode's summation tree over the intermediate dim (`leaves`): full layers
# against their tensor-parallel shards. FP8 leaves are whole 128-column scale blocks, so FP8
# cases need I % (8 * 128) == 0 (v3_slice: I 2048; tree_fp8_s2: two shared slices of 1024).
# The CPU shapes are tiny (the interpreter): leaves of 8 and 6 columns.
TREE_SHAPES = {
    **SHAPES,
    "tree_fp8_s2": (16, 6, 2, 2048, 1024),
    "tree_tiny_s1": (4, 2, 1, 96, 64),
    "tree_tiny_s2": (5, 2, 2, 96, 48),
}
TREE_CASES = [
    gpu_case(t, shape, fp8)
    for t in (1, 6)
    for shape, fp8 in (
        ("default", False),
        ("v3_slice", False),
        ("v2lite", False),  # S = 2, leaves of 176 columns
        ("v3_slice", True),
        ("tree_fp8_s2", True),
    )
] + [
    cpu_case(1, "tree_tiny_s1", False),
    cpu_case(3, "tree_tiny_s2", False),
]


def _tree_tiles(layer, leaves: int, device: str) -> dict:
    """The deterministic layer's tiles (`DeepseekMoE`): `decode_tiles` at several tokens, the
    down kernel's K step at most one leaf's width, so a function of the leaf's width (I / 8)
    alone, the same on every rank. Under the interpreter, wider block_n (fewer programs)."""
    from mlaserve.ops.moe_decode import decode_tiles

    tiles = decode_tiles(layer, num_tokens=2)
    leaf_pow2 = 1 << (layer.inter // leaves - 1).bit_length()
    block_k = (tiles.block_k[0], min(tiles.block_k[1], leaf_pow2))
    block_n = tiles.block_n if device == "cuda" else (64, 128)
    return {"block_n": block_n, "block_k": block_k, "num_warps": tiles.num_warps}


def _tp_shard(kernel: dict, scales: dict, inter: int, num_s: int, r: int, n: int):
    """Rank r of n's layer: each routed expert's gate rows [r I/n, (r+1) I/n), up rows I + the
    same and down columns the same; the shared MLP's likewise over its width S*I (one run of
    S*I/n); FP8 scales sliced with them (in 128-blocks), each tensor its own copy."""

    def rows(t, width, div):  # gate | up halves of a [..., 2 * width / div, :] stack
        run, half = width // n // div, width // div
        parts = [
            t[..., r * run : (r + 1) * run, :],
            t[..., half + r * run : half + (r + 1) * run, :],
        ]
        return torch.cat(parts, dim=-2).contiguous()

    def cols(t, width, div):
        run = width // n // div
        return t[..., r * run : (r + 1) * run].contiguous()

    widths = {"w13": inter, "w2": inter, "shared_w13": num_s * inter, "shared_w2": num_s * inter}
    shard_k, shard_s = {}, {}
    for name, width in widths.items():
        cut = rows if name.endswith("13") else cols
        if name in kernel:
            shard_k[name] = cut(kernel[name], width, 1)
        if name + "_scale" in scales:
            shard_s[name + "_scale"] = cut(scales[name + "_scale"], width, 128)
    return layer_weights(shard_k, shard_s)


@pytest.mark.parametrize("num_tokens,shape_name,fp8,device", TREE_CASES)
def test_leaves_are_tensor_parallel_invariant(num_tokens, shape_name, fp8, device):
    """`leaves=8`, fp32 out: bitwise the tree (`tree_sum`) of n rank shards' `leaves=8 // n`
    outputs (n = 2, 4, 8; each expert's intermediate dim and the shared MLP's S*I split in n
    contiguous runs), with the layer's tiles on every rank; its own rounding (one rank) the
    fp32 root's. Against the default path (`leaves=None`, the same tiles, so the same h): the
    difference is the fp32 order of the down sums and the default path's two roundings (each
    routed expert's output, and y), so |tree - default| <= eps(dtype) * (sum over slots of
    |the default path's weighted partial| + |default|), twice their unit roundoff."""
    from mlaserve.ops.invariant_rowwise import TREE_LEAVES, tree_sum
    from mlaserve.ops.moe_decode import moe_decode

    shape = TREE_SHAPES[shape_name]
    _, _, num_s, hidden, inter = shape
    dtype = model_dtype(device)
    kernel, _, scales, x, ids, weights, layer = _inputs(
        shape, fp8, num_tokens, device, num_tokens * 13
    )
    tiles = _tree_tiles(layer, TREE_LEAVES, device)
    y = moe_decode(x, weights, ids, layer, **tiles, leaves=TREE_LEAVES, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (num_tokens, hidden) and not y.isnan().any()
    for ranks in (2, 4, 8):
        leaves = TREE_LEAVES // ranks
        shares = []
        for r in range(ranks):
            shard = _tp_shard(kernel, scales, inter, num_s, r, ranks)
            assert _tree_tiles(shard, leaves, device) == tiles  # the layer's tiles on a rank
            shares.append(
                moe_decode(x, weights, ids, shard, **tiles, leaves=leaves, out_dtype=torch.float32)
            )
        assert torch.equal(tree_sum(torch.stack(shares)), y), ranks
    rounded = moe_decode(x, weights, ids, layer, **tiles, leaves=TREE_LEAVES)
    assert rounded.dtype == dtype and torch.equal(rounded, y.to(dtype))
    default = moe_decode(x, weights, ids, layer, **tiles)
    parts = moe_decode(x, weights, ids, layer, **tiles, combine=False).parts
    bound = torch.finfo(dtype).eps * (parts.abs().sum(1) + default.float().abs())
    err = (y - default.float()).abs()
    assert (err <= bound).all(), (err / bound).max()


def test_leaves_refuse_uneven_splits_and_uncombined_partials():
    """`moe_decode(leaves=...)`: leaves not dividing 8, an intermediate dim not in equal leaves
    (FP8: not in whole 128-column blocks) and `combine=False` (the tree is summed in the
    combine) are ValueErrors, raised before any launch."""
    from mlaserve.ops.moe_decode import MoeDecodeWeights, moe_decode

    x, ids, weights = torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2)
    layer = MoeDecodeWeights(torch.zeros(4, 2 * 36, 64), torch.zeros(4, 64, 36))
    with pytest.raises(ValueError, match="leaves"):
        moe_decode(x, weights, ids, layer, leaves=8)  # 36 columns in 8 leaves
    with pytest.raises(ValueError, match="leaves"):
        moe_decode(x, weights, ids, layer, leaves=3)
    with pytest.raises(ValueError, match="leaves"):
        moe_decode(x, weights, ids, layer, leaves=16)
    layer = MoeDecodeWeights(torch.zeros(4, 2 * 32, 64), torch.zeros(4, 64, 32))
    with pytest.raises(ValueError, match="combine"):
        moe_decode(x, weights, ids, layer, leaves=2, combine=False)
    gen = torch.Generator().manual_seed(0)
    kernel, _, scales = make_weights(SHAPES["default"], True, torch.float32, "cpu", gen)
    fp8 = layer_weights(kernel, scales)  # I = 128: one 128-column block
    x = torch.zeros(1, SHAPES["default"][3])
    with pytest.raises(ValueError, match="leaves"):
        moe_decode(x, weights, ids, fp8, leaves=2)  # 64-column FP8 leaves


@pytest.mark.parametrize("op", ["moe_decode", "moe_grouped"])
def test_no_tokens_keep_the_form_of_any_other_count(op):
    """An empty batch (the last layer of a prefill chunk without logits rows) returns what any
    other does: [0, H] in x's dtype combined, fp32 `MoePartials` [0, slots, H] uncombined (the
    form a tensor-parallel norm all-reduces; a bf16 [0, H] there killed a TP2 engine)."""
    import importlib

    from mlaserve.ops.moe_partials import MoePartials

    _, top_k, num_s, hidden, _ = shape = SHAPES["tiny"]
    gen = torch.Generator().manual_seed(0)
    kernel, _, scales = make_weights(shape, False, torch.float16, "cpu", gen)
    run = getattr(importlib.import_module(f"mlaserve.ops.{op}"), op)
    x = torch.zeros(0, hidden, dtype=torch.float16)
    ids, weights = torch.zeros(0, top_k, dtype=torch.int64), torch.zeros(0, top_k)
    args = (x, weights, ids, layer_weights(kernel, scales))
    combined = run(*args)
    assert combined.dtype == x.dtype and combined.shape == (0, hidden)
    parts = run(*args, combine=False)
    assert isinstance(parts, MoePartials) and parts.dtype == x.dtype
    assert parts.parts.dtype == torch.float32 and parts.parts.shape == (0, top_k + num_s, hidden)
