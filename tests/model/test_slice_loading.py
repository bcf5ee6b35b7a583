"""Each tensor-parallel rank reads only its slices of the safetensors (issue 42, item 5).

The loader's file reader (the staged path's memory-mapped `CheckpointFile`, and `safe_open` of
the `staged=False` path: both are tested) is wrapped by a recorder that counts what every read
through it returns (`get_slice(key)[...]` and `get_tensor(key)`), on real checkpoints the
tests write: a float V3 MoE and the same in FP8 128x128 blocks with every TP2 split block-aligned.
Per rank it shows that

    - no tensor that the rank keeps a shard of is read whole: it reads exactly half of it, and the
      two ranks read disjoint halves (replicated tensors: the whole, on both);
    - the rank reads less than the checkpoint (its share: replicated + half of the sharded),
      and the two ranks together read the checkpoint's bytes once for the sharded tensors;
    - under expert parallelism a rank reads only its experts (the other half not at all);

and that the TP2 (and EP2) ranks' parameters equal the matching slices of TP1's.
`CheckpointTensor` itself: FP8 narrowing that would split a scale block raises naming it; a
dequantised region of any alignment equals the slice of the whole dequantised tensor.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open as real_safe_open

import mlaserve.model.loader as loader_module
from mlaserve.config import ModelConfig
from mlaserve.model import load_model
from mlaserve.model.checkpoint_file import CheckpointFile
from mlaserve.model.checkpoint_tensor import CheckpointTensor
from mlaserve.ops.fp8_quant import dequantize_weight_block, quantize_weight_block
from mlaserve.tensor_parallel import NO_TP, TensorParallel
from tests.checkpoints import make_checkpoint
from tests.model.tp_steps import FP8_TP2_DIMS

# A tiny V3 whose every TP2 split lands on a 128 boundary.
ALIGNED = FP8_TP2_DIMS
# Sharded under TP2: heads (q_b / q_proj, kv_b, o_proj), MLP and expert intermediates,
# vocabulary. Everything else (norms, q_a / kv_a, the router) is replicated.
SHARDED = ("q_b_proj", "q_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARDED += ("embed_tokens", "lm_head", "experts.gate_up_proj", "experts.down_proj")


class _Recorder:
    """Every read through the wrapped safetensors API: key -> [(elements, region)]."""

    def __init__(self) -> None:
        self.reads: dict[str, list[tuple[int, tuple]]] = defaultdict(list)
        self.bytes = 0

    def note(self, key: str, region: tuple, t: torch.Tensor) -> None:
        self.reads[key].append((t.numel(), region))
        self.bytes += t.numel() * t.element_size()


class _Slice:
    def __init__(self, inner: Any, key: str, rec: _Recorder) -> None:
        self._inner, self._key, self._rec = inner, key, rec

    def get_shape(self) -> list[int]:
        return self._inner.get_shape()

    def get_dtype(self) -> str:
        return self._inner.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self._inner[index]
        region = tuple((s.start, s.stop) for s in index) if isinstance(index, tuple) else index
        self._rec.note(self._key, region, t)
        return t


class _File:
    def __init__(self, inner: Any, rec: _Recorder) -> None:
        self._f, self._rec = inner, rec

    def __enter__(self) -> _File:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._f.keys()

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._f.get_slice(key), key, self._rec)

    def get_tensor(self, key: str) -> torch.Tensor:
        t = self._f.get_tensor(key)
        self._rec.note(key, "whole", t)
        return t


def _load(
    path: Path,
    tp: TensorParallel,
    keep_fp8: bool,
    monkeypatch: pytest.MonkeyPatch,
    staged: bool = True,
) -> tuple[Any, _Recorder]:
    rec = _Recorder()
    monkeypatch.setattr(
        loader_module, "safe_open", lambda p, **kw: _File(real_safe_open(p, **kw), rec)
    )
    monkeypatch.setattr(loader_module, "CheckpointFile", lambda p: _File(CheckpointFile(p), rec))
    config = ModelConfig.from_pretrained(path)
    return load_model(config, path, tp=tp, keep_fp8=keep_fp8, staged=staged), rec


def _checkpoint_bytes(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """key -> elements, key -> bytes, of every tensor in the checkpoint."""
    numel, nbytes = {}, {}
    for file in sorted(path.glob("*.safetensors")):
        with real_safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                t = f.get_tensor(key)
                numel[key], nbytes[key] = t.numel(), t.numel() * t.element_size()
    return numel, nbytes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tools.fp8_checkpoint import quantize_checkpoint_fp8_block

    root = tmp_path_factory.mktemp("slices")
    src = make_checkpoint(root / "float", "v3_moe", **ALIGNED)
    return {"float": src, "fp8": quantize_checkpoint_fp8_block(src, root / "fp8")}


def _is_sharded(key: str) -> bool:
    return any(part in key for part in SHARDED) and "norm" not in key


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "safe_open"])
@pytest.mark.parametrize("kind", ["float", "fp8"])
def test_each_tp_rank_reads_only_its_slices(
    kind: str, staged: bool, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoints[kind]
    numel, nbytes = _checkpoint_bytes(path)
    recs = [
        _load(path, TensorParallel(r, 2), kind == "fp8", monkeypatch, staged)[1] for r in range(2)
    ]
    sharded = sum(n for k, n in nbytes.items() if _is_sharded(k) and not k.endswith("scale_inv"))
    assert sharded > sum(nbytes.values()) / 2  # the test means something: most bytes split
    for rank, rec in enumerate(recs):
        for key, reads in rec.reads.items():
            assert all(region != "whole" for _, region in reads), f"{key}: read whole"
            got = sum(n for n, _ in reads)
            if kind == "fp8" and "kv_b_proj" in key:
                # dequantised at load (mla.py): its 192-row half widens to whole 128-row blocks
                assert numel[key] // 2 <= got < numel[key], f"rank {rank} {key}: {got}"
            elif _is_sharded(key) and not key.endswith("scale_inv"):
                assert got == numel[key] // 2, f"rank {rank} {key}: {got} of {numel[key]}"
            elif not key.endswith("scale_inv"):
                assert got == numel[key], f"rank {rank} {key}: replicated, read {got}"
        total = sum(nbytes.values())
        print(f"{kind} rank {rank}: read {rec.bytes} of the checkpoint's {total} bytes")
        # its share: replicated + half the sharded (+ kv_b_proj's widened blocks, in FP8)
        widened = sum(n for k, n in nbytes.items() if "kv_b_proj" in k) // 2 * (kind == "fp8")
        assert rec.bytes <= total - sharded // 2 + widened
    for key in recs[0].reads:
        if _is_sharded(key):
            regions = [{r for _, r in rec.reads[key]} for rec in recs]
            if "kv_b_proj" not in key:  # the dequantised one shares its middle block
                assert not regions[0] & regions[1], f"{key}: both ranks read {regions[0]}"


def _compare_to_tp1(whole: Any, part: Any, tp: TensorParallel) -> int:
    """Every parameter of `part` (a TP2/EP2 rank's model) against TP1's: equal to the slice the
    rank should hold. Returns the number of parameters that were split."""
    ref = dict(whole.named_parameters())
    split = 0
    for name, p in part.named_parameters():
        w = ref[name]
        a, b = p.data, w.data
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        if a.shape == b.shape:
            assert torch.equal(a, b), f"{name}: replicated, differs"
            continue
        split += 1
        dims = [d for d in range(a.dim()) if a.shape[d] != b.shape[d]]
        assert len(dims) == 1, f"{name}: {list(a.shape)} vs {list(b.shape)}"
        dim, n = dims[0], a.shape[dims[0]]
        if "gate_up_proj" in name and dim == a.dim() - 2:  # [gate_r; up_r], each halved
            half, whole_half = n // 2, b.shape[dim] // 2
            for s in (0, 1):
                want = b.narrow(dim, s * whole_half + tp.rank * half, half)
                assert torch.equal(a.narrow(dim, s * half, half), want), f"{name} part {s}"
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = min(n, b.shape[0] - tp.rank * n)
            assert torch.equal(a[:rows], b.narrow(0, tp.rank * n, rows)), name
        else:
            assert torch.equal(a, b.narrow(dim, tp.rank * n, n)), f"{name} along {dim}"
    return split


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "safe_open"])
@pytest.mark.parametrize("kind", ["float", "fp8"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_rank_shards_equal_slices_of_the_whole(
    kind: str,
    expert_parallel: bool,
    staged: bool,
    checkpoints: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, keep = checkpoints[kind], kind == "fp8"
    whole, _ = _load(path, NO_TP, keep, monkeypatch, staged)
    numel, _ = _checkpoint_bytes(path)
    for rank in range(2):
        tp = TensorParallel(rank, 2, expert_parallel=expert_parallel)
        with caplog.at_level(logging.INFO, logger="mlaserve.model.loader"):
            part, rec = _load(path, tp, keep, monkeypatch, staged)
        assert f"rank {rank}/2 read" in caplog.text and "GB/s" in caplog.text
        assert _compare_to_tp1(whole, part, tp) > 0
        if not expert_parallel:
            continue
        # EP: whole experts, the rank's own only; the other rank's are never read
        first = rank * part.model.layers[1].mlp.experts.num_experts
        mine = range(first, first + part.model.layers[1].mlp.experts.num_experts)
        for key in numel:
            if ".mlp.experts." in key and not key.endswith("scale_inv"):
                e = int(key.split(".mlp.experts.")[1].split(".")[0])
                got = sum(n for n, _ in rec.reads.get(key, []))
                assert got == (numel[key] if e in mine else 0), f"rank {rank} {key}: {got}"


# ----- CheckpointTensor -----


def test_fp8_narrow_that_splits_a_block_raises() -> None:
    w, s = quantize_weight_block(torch.randn(384, 256))
    t = CheckpointTensor(w, w.shape, name="layer.weight", scale=s)
    assert t.narrow(0, 128, 256).load_scale().shape == (2, 2)
    with pytest.raises(
        ValueError, match=r"layer\.weight: .*rows \[192, 384\) of dim 0 would split"
    ):
        t.narrow(0, 192, 192)
    with pytest.raises(ValueError, match=r"rows \[0, 64\) of dim 1 would split a 128-wide"):
        t.narrow(1, 0, 64)


@pytest.mark.parametrize(("dim", "start", "length"), [(0, 0, 100), (0, 100, 200), (1, 37, 150)])
def test_dequantised_region_equals_slice_of_whole(dim: int, start: int, length: int) -> None:
    w, s = quantize_weight_block(torch.randn(300, 260, generator=torch.Generator().manual_seed(0)))
    t = CheckpointTensor(w, w.shape, name="kv_b", scale=s, dequantize=True)
    part = t.narrow(dim, start, length)
    expected = dequantize_weight_block(w, s).narrow(dim, start, length)
    assert torch.equal(part.load(), expected)
    # read: whole blocks around the region, at most one block past each edge
    assert t._stats.bytes <= (length + 2 * 128) * w.shape[1 - dim] + s.numel() * 4


def test_select_and_narrow_compose() -> None:
    full = torch.arange(4 * 6 * 5.0).view(4, 6, 5)
    t = CheckpointTensor.from_tensor(full).narrow(0, 2, 2).select(1).narrow(0, 3, 2)
    assert t.shape == (2, 5) and torch.equal(t.load(), full[3, 3:5])


def test_corrupt_scale_is_named_where_read() -> None:
    w, s = quantize_weight_block(torch.randn(256, 128))
    s[1, 0] = float("nan")
    t = CheckpointTensor(w, w.shape, name="o.weight", scale=s, scale_name="o.weight_scale_inv")
    assert t.narrow(0, 0, 128).load_scale() is not None  # the corrupt block is not this rank's
    with pytest.raises(ValueError, match=r"o\.weight_scale_inv: block scale is corrupt"):
        t.narrow(0, 128, 128).load_scale()
