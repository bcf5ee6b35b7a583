"""The staged weight load (memory-mapped files, reader threads; pinned staging on CUDA) gives
parameters bit-identical to the `safe_open` path it replaced, on every layer kind.

Each case loads the same checkpoint twice on the CPU, `staged=True` (4 reader threads) and
`staged=False`, and compares every parameter byte for byte: float MoE with MTP (embedding,
MLA, dense and expert MLPs, router, norms, head), bf16 storage cast to fp32, transformers' fused
expert tensors, FP8 128x128 block weights kept FP8 (weight and scale) and dequantised, a
sharded (multi-file) checkpoint, and TP2 / EP2 ranks (each reads its slices only: see
test_slice_loading.py, which checks the staged reader's regions). `CheckpointFile` itself:
every dtype read through its views equals safetensors' own read; a truncated file or a bad
header entry is refused naming the file and the tensor. The GPU side (`WeightStager`) is
tested in test_weight_stager_gpu.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mlaserve.config import ModelConfig
from mlaserve.model import WeightLoadError, load_model
from mlaserve.model.checkpoint_file import CheckpointFile, index_checkpoint
from mlaserve.tensor_parallel import TensorParallel
from tests.checkpoints import make_checkpoint
from tests.model.tp_steps import FP8_TP2_DIMS as ALIGNED
from tools.fp8_checkpoint import quantize_checkpoint_fp8_block


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _both(path: Path, **kwargs: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = ModelConfig.from_pretrained(path)
    return tuple(load_model(config, path, staged=s, **kwargs) for s in (True, False))


def _assert_identical(staged: torch.nn.Module, plain: torch.nn.Module) -> int:
    a, b = dict(staged.named_parameters()), dict(plain.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(_bytes(a[name]), _bytes(b[name])), f"{name} differs"
    return len(a)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("staged")


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_float_moe_with_mtp_is_identical(root: Path) -> None:
    path = make_checkpoint(root, "v3_mtp")
    staged, plain = _both(path)
    assert staged.mtp is not None
    assert _assert_identical(staged, plain) > 20


def test_bf16_storage_cast_to_fp32_is_identical(root: Path) -> None:
    def to_bf16(state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            state[k] = v.to(torch.bfloat16)

    path = _rewrite(make_checkpoint(root, "v3_moe"), root / "bf16", to_bf16)
    for dtype in (torch.float32, torch.bfloat16):
        _assert_identical(*_both(path, dtype=dtype))


def test_fused_expert_tensors_are_identical(root: Path) -> None:
    def fuse(state: dict[str, torch.Tensor]) -> None:
        for layer in (1, 2):
            base = f"model.layers.{layer}.mlp.experts"
            ids = sorted({int(k.split(".")[5]) for k in state if k.startswith(base + ".")})
            one = {
                (e, p): state.pop(f"{base}.{e}.{p}.weight")
                for e in ids
                for p in ("gate_proj", "up_proj", "down_proj")
            }
            gate_up = [torch.cat([one[e, "gate_proj"], one[e, "up_proj"]]) for e in ids]
            state[f"{base}.gate_up_proj"] = torch.stack(gate_up)
            state[f"{base}.down_proj"] = torch.stack([one[e, "down_proj"] for e in ids])

    path = _rewrite(make_checkpoint(root / "fused", "v3_moe"), root / "fused_out", fuse)
    _assert_identical(*_both(path))


@pytest.mark.parametrize("keep_fp8", [True, False], ids=["kept", "dequantised"])
def test_fp8_block_weights_are_identical(root: Path, keep_fp8: bool) -> None:
    fp8 = root / "fp8"
    if not fp8.exists():
        src = make_checkpoint(root / "fp8src", "v3_mtp", **ALIGNED)
        quantize_checkpoint_fp8_block(src, fp8)
    staged, plain = _both(fp8, keep_fp8=keep_fp8)
    params = dict(staged.named_parameters())
    assert any(p.dtype == torch.float8_e4m3fn for p in params.values()) == keep_fp8
    assert any(n.endswith("_scale_inv") for n in params) == keep_fp8
    _assert_identical(staged, plain)


def test_sharded_checkpoint_is_identical(root: Path) -> None:
    path = make_checkpoint(root / "sharded", "v3_moe", max_shard_size="200KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    _assert_identical(*_both(path))


@pytest.mark.parametrize("kind", ["float", "fp8"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_tensor_parallel_ranks_are_identical(root: Path, kind: str, expert_parallel: bool) -> None:
    path = root / f"tp-{kind}"
    if not path.exists():
        src = make_checkpoint(root / "tpsrc", "v3_moe", **ALIGNED)
        if kind == "fp8":
            quantize_checkpoint_fp8_block(src, path)
        else:
            path = src
    for rank in range(2):
        tp = TensorParallel(rank, 2, expert_parallel=expert_parallel)
        _assert_identical(*_both(path, tp=tp, keep_fp8=kind == "fp8"))


# ----- CheckpointFile -----


def test_views_equal_safetensors_reads(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(3, 129, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, 4, generator=g).half(),
        "fp8": torch.randn(4, 256, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.arange(6).reshape(2, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    file = tmp_path / "t.safetensors"
    save_file(tensors, file)
    with CheckpointFile(file) as f, safe_open(file, framework="pt") as ref:
        assert sorted(f.keys()) == sorted(ref.keys())
        for key in ref.keys():  # noqa: SIM118
            view = f.get_slice(key)
            want = ref.get_tensor(key)
            assert f.entry(key) == (ref.get_slice(key).get_dtype(), tuple(want.shape))
            assert view.dtype == want.dtype and torch.equal(_bytes(view), _bytes(want)), key
        region = f.get_slice("bf16")[1:3, 5:100]
    # a view outlives the file's context (torch holds the mapping)
    assert torch.equal(_bytes(region), _bytes(tensors["bf16"][1:3, 5:100]))


def _raw_file(path: Path, header: object, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    header = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}
    file = _raw_file(tmp_path / "model.safetensors", header, bytes(32))
    with pytest.raises(ValueError, match=r"^w: data offsets .* F32 \[4, 4\] in model.safetensors"):
        CheckpointFile(file)
    with pytest.raises(WeightLoadError, match=r"^w: data offsets"):
        index_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ([1, 2], "header is not a JSON object"),
        ({"w": {"dtype": "F32", "shape": [2]}}, "w: malformed safetensors header entry"),
    ],
)
def test_bad_header_is_named(tmp_path: Path, header: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CheckpointFile(_raw_file(tmp_path / "x.safetensors", header, bytes(8)))


def test_unknown_dtype_is_refused_where_read(tmp_path: Path) -> None:
    header = {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}
    with CheckpointFile(_raw_file(tmp_path / "x.safetensors", header, bytes(8))) as f:
        assert f.entry("w") == ("F4", (2,))
        with pytest.raises(ValueError, match="w: unsupported safetensors dtype F4"):
            f.get_slice("w")
