"""One safetensors file, memory-mapped: every tensor a zero-copy CPU view of the page cache.

The staged loader (`loader.py`) reads through this instead of `safe_open(...).get_slice(key)`:
slicing a view costs nothing, and the one copy of a region (into a pinned staging buffer, or
straight into a CPU parameter) is a torch copy, which releases the GIL and runs on torch's
intra-op threads, so several reader threads can fault pages in at once.

    with CheckpointFile(path) as f:
        f.keys()                    the tensor names, in file order
        f.entry(key)                (safetensors dtype string, shape), from the header
        f.get_slice(key)            the tensor as a CPU view (index it to narrow; nothing read)

The format (safetensors' spec): 8 bytes little-endian header length N, N bytes of JSON
{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...}, then the data,
offsets relative to byte 8 + N. The mapping is private copy-on-write (`ACCESS_COPY`): torch
wants a writable buffer, and no write can reach the file. A view keeps the mapping alive after
the file is closed (torch holds the buffer), so a layer may keep what it loaded.

`index_checkpoint(folder)` lists every tensor of a checkpoint folder from the headers alone
(key -> file, dtype, shape); `WeightLoadError` is the loader's error, raised here for a folder
without weights or a malformed file.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "SAFETENSORS_DTYPES",
    "CheckpointFile",
    "IndexEntry",
    "WeightLoadError",
    "checkpoint_files",
    "index_checkpoint",
]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class CheckpointFile:
    """A memory-mapped safetensors file (see the module docstring). Raises ValueError naming the
    file on a malformed header, and naming the key on a tensor whose dtype or offsets are bad."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path.name}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise ValueError(f"{self.path.name}: safetensors header of {n} bytes is too large")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise ValueError(f"{self.path.name}: unreadable safetensors header ({e})") from None
            # a file of header only (no tensors) has nothing to map; mmap refuses empty files
            self._bytes = (
                torch.frombuffer(
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8
                )
                if self.path.stat().st_size > 8 + n
                else torch.empty(0, dtype=torch.uint8)
            )
        if not isinstance(header, dict):
            raise ValueError(f"{self.path.name}: safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self._header: dict[str, dict[str, Any]] = header
        self._data_start = 8 + n
        for key in header:  # a truncated or inconsistent file fails here, naming the tensor
            self._span(key)
        # file order, as safe_open's keys() (sorted there too): tensors are stored by offset
        self._keys = sorted(header, key=lambda k: (header[k]["data_offsets"][0], k))

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)  # views already handed out stay valid

    def keys(self) -> list[str]:
        return list(self._keys)

    def entry(self, key: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) of `key`, from the header."""
        meta = self._header[key]
        return meta["dtype"], tuple(int(d) for d in meta["shape"])

    def _span(self, key: str) -> tuple[int, int]:
        """[begin, end) of `key`'s bytes in the file, checked against its dtype and shape."""
        meta = self._header[key]
        try:
            dtype_name, shape = self.entry(key)
            begin, end = (self._data_start + int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{key}: malformed safetensors header entry in {self.path.name} ({e})"
            ) from None
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        size = math.prod(shape) * (dtype.itemsize if dtype is not None else 1)
        if end > self._bytes.numel() or end < begin or (dtype is not None and end - begin != size):
            raise ValueError(
                f"{key}: data offsets [{begin}, {end}) do not hold {dtype_name} {list(shape)} "
                f"in {self.path.name} ({self._bytes.numel()} bytes)"
            )
        return begin, end

    def get_slice(self, key: str) -> torch.Tensor:
        """`key` as a zero-copy CPU view of the mapping (a copy when its offset is not aligned to
        its element size, which safetensors' writers never produce)."""
        dtype_name, shape = self.entry(key)
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"{key}: unsupported safetensors dtype {dtype_name}")
        begin, end = self._span(key)
        raw = self._bytes[begin:end]
        if begin % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).view(shape)


class WeightLoadError(ValueError):
    """The checkpoint's weights cannot be loaded; the message names the key and the problem."""


class IndexEntry(NamedTuple):
    """One checkpoint tensor as its file's header describes it."""

    file: Path
    dtype: str  # safetensors' name: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]


def index_checkpoint(path: Path) -> dict[str, IndexEntry]:
    """key -> (file, safetensors dtype string, shape), from the headers only."""
    index: dict[str, IndexEntry] = {}
    for file in checkpoint_files(path):
        try:
            with CheckpointFile(file) as f:  # the header only; no mapped page is touched
                index.update((key, IndexEntry(file, *f.entry(key))) for key in f.keys())  # noqa: SIM118
        except ValueError as e:
            raise WeightLoadError(str(e)) from None
    return index


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of checkpoint folder `path` (its index's shards, when it has one)."""
    if not path.is_dir():
        raise WeightLoadError(f"model path {str(path)!r} is not a directory")
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        with open(index_file) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [p.name for p in files if not p.is_file()]
        if absent:
            raise WeightLoadError(f"{index_file.name} lists shards that do not exist: {absent}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {str(path)!r}")
    return files
