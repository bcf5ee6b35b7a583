"""Checkpoint load speed, GB/s: the staged loader against the `safe_open` path it replaced, with
the two floors that bound it (issue 44: >= 3 GB/s per GPU from the page cache).

    python3 bench/weight_load.py                                # /dev/shm/v3lite, cuda, bf16
    python3 bench/weight_load.py --model DIR --tp-size 2 --tp-rank 1 --threads 1,4,8

Rows, in this order (the first warms the page cache for the others):
    page cache read   every tensor of the checkpoint read with safetensors' `get_tensor` into
                      CPU memory: bytes / s. What one thread gets out of the page cache.
    H2D pinned copy   a 256 MB pinned buffer copied to the device, repeated: the DMA ceiling
                      (CUDA only).
    load safe_open    `load_weights(staged=False)`: this rank's bytes / wall time, on a model
                      built on `--device` in `--dtype` (the time includes the device sync)
    load staged       `load_weights(staged=True)` with N reader threads, per `--threads` value
Construction, post-processing and kernel warm-up are not timed. `--tp-size`/`--tp-rank` build
one rank's shard in this process (its slices only are read). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from mlaserve.config import ModelConfig  # noqa: E402
from mlaserve.model.checkpoint_file import checkpoint_files, index_checkpoint  # noqa: E402
from mlaserve.model.deepseek import DeepseekForCausalLM  # noqa: E402
from mlaserve.model.loader import fp8_runs_on, load_weights  # noqa: E402
from mlaserve.tensor_parallel import TensorParallel  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
H2D_BYTES = 256 << 20


def page_cache_gb_s(path: Path) -> tuple[int, float]:
    """(bytes, GB/s) of reading every tensor with safetensors into CPU memory."""
    total, start = 0, time.perf_counter()
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
                del t
    return total, total / 1e9 / max(time.perf_counter() - start, 1e-9)


def h2d_pinned_gb_s(device: torch.device, repeat: int = 8) -> float | None:
    """Pinned host -> device copy bandwidth, GB/s (None off CUDA)."""
    if device.type != "cuda":
        return None
    src = torch.empty(H2D_BYTES, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(H2D_BYTES, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # first copy: driver set-up, not timed
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return H2D_BYTES * repeat / 1e9 / (time.perf_counter() - start)


def timed_load(
    path: Path, device: torch.device, dtype: torch.dtype, tp: TensorParallel, *, staged: bool,
    threads: int,
) -> dict[str, object]:  # fmt: skip
    """Build the model (untimed), load its weights (timed, device synced); one result row."""
    config = ModelConfig.from_pretrained(path)
    index = index_checkpoint(path)
    mtp_prefix = f"model.layers.{config.num_hidden_layers}."
    with_mtp = config.num_nextn_predict_layers > 0 and any(k.startswith(mtp_prefix) for k in index)
    quant = config.quantization if fp8_runs_on(device) else None
    with torch.device(device):
        model = DeepseekForCausalLM(
            config, params_dtype=dtype, tp=tp, with_mtp=with_mtp, quant=quant
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    stats = load_weights(model, path, index, tp=tp, staged=staged, threads=threads)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "path": "staged" if staged else "safe_open",
        "threads": threads if staged else 1,
        "bytes": stats.bytes,
        "seconds": round(seconds, 3),
        "gb_s": round(stats.bytes / 1e9 / max(seconds, 1e-9), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("/dev/shm/v3lite"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--threads", default="4", help="comma-separated reader thread counts")
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tp = TensorParallel(opts.tp_rank, opts.tp_size)
    dtype = DTYPES[opts.dtype]
    threads = [int(n) for n in opts.threads.split(",")]

    total, page_cache = page_cache_gb_s(opts.model)
    h2d = h2d_pinned_gb_s(device)
    loads = [timed_load(opts.model, device, dtype, tp, staged=False, threads=1)]
    loads += [timed_load(opts.model, device, dtype, tp, staged=True, threads=n) for n in threads]

    print(f"{opts.model}: {total / 1e9:.2f} GB, {device}, {opts.dtype}, tp {tp.rank}/{tp.size}")
    print(f"  {'page cache read (safetensors)':<34} {page_cache:8.2f} GB/s")
    print(f"  {'H2D pinned copy':<34} " + ("     n/a" if h2d is None else f"{h2d:8.2f} GB/s"))
    for row in loads:
        name = f"load {row['path']}" + (f" ({row['threads']} readers)" * (row["path"] == "staged"))
        print(f"  {name:<34} {row['gb_s']:8.2f} GB/s  ({row['bytes'] / 1e9:.2f} GB "
              f"in {row['seconds']:.2f} s)")  # fmt: skip
    print(json.dumps({
        "model": str(opts.model), "device": str(device), "dtype": opts.dtype,
        "tp_rank": tp.rank, "tp_size": tp.size, "checkpoint_bytes": total,
        "page_cache_gb_s": round(page_cache, 3),
        "h2d_pinned_gb_s": None if h2d is None else round(h2d, 3), "loads": loads,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
