"""Load a HF DeepSeek-V2/V3 safetensors checkpoint into `DeepseekForCausalLM`.

Checkpoint key -> parameter mapping (the only places our names differ from HF's):

    model.layers.{i}.mlp[.shared_experts].{gate,up}_proj.weight -> ...gate_up_proj.weight [0|1]
    model.layers.{i}.self_attn.{q_a_proj|q_proj, kv_a_proj_with_mqa}.weight
                                        -> self_attn.fused_qkv_a_proj_with_mqa.weight [0|1]
    model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight  -> mlp.experts.gate_up_proj [e][0|1]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight       -> mlp.experts.down_proj [e]
      (or transformers' fused `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I])
    model.layers.{N}.{enorm,hnorm,eh_proj,embed_tokens,shared_head.*} -> mtp.*    (N = #layers)
    model.layers.{N}.{self_attn,mlp,*_layernorm}.*                    -> mtp.block.*

FP8-KV checkpoints may carry a per-layer latent-cache scale (`model.layers.{i}.self_attn.k_scale`,
or `kv_scale`, or under `self_attn.attn.`): `load_kv_scales` reads those for the KV pool.

FP8 block-quantized checkpoints (config.json `quantization_config`, DeepSeek-V3/R1/Kimi-K2):
every F8_E4M3 weight `X.weight` [N, K] comes with `X.weight_scale_inv` (or `X.scale`, as some
re-exports name it) of shape [ceil(N/128), ceil(K/128)], float, finite and > 0; anything else is
a `WeightLoadError` naming the tensor. Where the model keeps FP8 (`keep_fp8`, default on CUDA
SM89+ with Triton) weight and scale go to the layer as they are; elsewhere (CPU: the reference
the tests run) the weight is dequantised (W = W_fp8 * scale, fp32) and cast to the model dtype.
`kv_b_proj` (and MTP's `eh_proj`) are always dequantised: see `mla.py`.

Each tensor reaches its parameter's `weight_loader` as a `CheckpointTensor`
(`checkpoint_tensor.py`): a lazy view of `safe_open(...).get_slice(key)` that the layer narrows
to this rank's shard before reading it, so a tensor-parallel rank reads only its slices (and an
expert-parallel rank only its experts); an FP8 weight carries its block scale, sliced with it.
The parameter dtype cast happens on copy (on the device). Every failure raises `WeightLoadError`
naming the key. Ranks are separate processes and load at once; each logs its bytes read and GB/s.

Reading is staged (issue 44: weights at page-cache speed): the files are memory-mapped
(`checkpoint_file.py`), a few reader threads run the weight loaders of one shard at once, and on
CUDA every region goes page cache -> pinned slot -> asynchronous DMA (`weight_stager.py`, where
the rule for reusing a slot is written). `staged=False` is the single-threaded `safe_open` path
with pageable copies that it replaced, kept for bench/weight_load.py's comparison.

`load_format="dummy"` reads no safetensors: the model (with its MTP layer when config.json has
one) is filled with seeded random weights on its device (`dummy_weights.py`), then derived as
after a real load.
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mlaserve.config import LOAD_FORMATS, ModelConfig
from mlaserve.model.checkpoint_file import (
    CheckpointFile,
    IndexEntry,
    WeightLoadError,
    index_checkpoint,
)
from mlaserve.model.checkpoint_tensor import CheckpointTensor, ReadStats
from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.dummy_weights import fill_dummy_weights
from mlaserve.model.layers.linear import NO_TP, TensorParallel, default_weight_loader
from mlaserve.model.weight_stager import WeightStager
from mlaserve.ops.fp8_quant import FP8_DTYPE, triton_available
from mlaserve.startup_times import StartupTimes

__all__ = ["WeightLoadError", "fp8_runs_on", "load_kv_scales", "load_model", "load_weights"]

logger = logging.getLogger(__name__)

# Reader threads of the staged load: each copies a region at a time (GIL released), so a few
# keep the page cache -> pinned copies and the DMAs busy; more only contend for memory bandwidth.
DEFAULT_READER_THREADS = 4
_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_FP8_DTYPE = "F8_E4M3"
_SCALE_SUFFIXES = ("weight_scale_inv", "scale")  # X.weight -> X.weight_scale_inv | X.scale
_KV_SCALE_KEY = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(?:k_scale|kv_scale)$")
# MTP copies that some checkpoints drop; absent ones are tied to the main model's.
_MTP_TIED = {
    "mtp.embed_tokens.weight": "model.embed_tokens.weight",
    "mtp.shared_head.head.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class _Route:
    param_name: str
    kwargs: dict[str, Any]


def load_model(
    model_config: ModelConfig,
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp: TensorParallel = NO_TP,
    keep_fp8: bool | None = None,
    load_format: str = "auto",
    seed: int = 0,
    deterministic: bool = False,
    startup: StartupTimes | None = None,
    staged: bool = True,
    warm_up_kernels: bool = True,
) -> DeepseekForCausalLM:
    """Build the model on `device` in `dtype`, load the checkpoint at `path`, eval mode, no grad.

    The MTP module is built when the config asks for one and the checkpoint carries it.
    `keep_fp8` (FP8 checkpoints only): keep the block-quantized weights in FP8 and run block-FP8
    GEMMs; None = `fp8_runs_on(device)`. False dequantises them to `dtype` at load. True on CPU
    runs the emulated FP8 math (tests). `load_format` "dummy": no checkpoint read, random weights
    from `seed` (the MTP module whenever the config asks for one). `deterministic`: build the
    batch-invariant layers (`EngineConfig.deterministic_inference`). `startup`: gets the
    model_construction, weight_read (with the bytes read), weight_postprocess and kernel_warmup
    phases. `staged`: see `load_weights`. `warm_up_kernels`: False leaves the decode kernels'
    warm-up to the caller (`DeepseekForCausalLM.kernel_warm_up_tasks`; the engine runs it in
    the background)."""
    startup = StartupTimes() if startup is None else startup
    if dtype not in _MODEL_DTYPES:
        raise WeightLoadError(f"dtype: expected one of {_MODEL_DTYPES}, got {dtype}")
    if load_format not in LOAD_FORMATS:
        raise WeightLoadError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
    if keep_fp8 is None:
        keep_fp8 = fp8_runs_on(torch.device(device))
    quant = model_config.quantization if keep_fp8 else None
    path = Path(path)
    dummy = load_format == "dummy"
    start = time.perf_counter()
    index = {} if dummy else index_checkpoint(path)
    mtp_prefix = f"model.layers.{model_config.num_hidden_layers}."
    with_mtp = model_config.num_nextn_predict_layers > 0 and (
        dummy or any(key.startswith(mtp_prefix) for key in index)
    )
    if model_config.num_nextn_predict_layers > 0 and not with_mtp:
        logger.info("config has num_nextn_predict_layers but %s has no MTP weights", path)
    with torch.device(device):
        model = DeepseekForCausalLM(
            model_config, params_dtype=dtype, tp=tp, with_mtp=with_mtp, quant=quant,
            deterministic=deterministic,
        )  # fmt: skip
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    built = time.perf_counter()
    startup.add("model_construction", built - start)
    # What this rank read (None: dummy weights), for the engine's per-rank GB/s line.
    model.checkpoint_reads = None
    if dummy:
        fill_dummy_weights(model, seed)
    else:
        model.checkpoint_reads = load_weights(model, path, index, tp=tp, staged=staged)
        startup.weight_bytes += model.checkpoint_reads.bytes
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # the fill is asynchronous: time it done
    read = time.perf_counter()
    startup.add("weight_read", read - built)
    size = sum(p.nbytes for p in model.parameters())  # tied ones once
    logger.info(
        "weights: load format %r, %.2f GB (%s%s) in %.2f s",
        load_format, size / 1e9, "FP8 blocks, " if quant is not None else "", dtype,
        time.perf_counter() - start,
    )  # fmt: skip
    model.process_weights_after_loading()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    processed = time.perf_counter()
    startup.add("weight_postprocess", processed - read)
    if warm_up_kernels:
        model.warm_up_decode_kernels()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        startup.add("kernel_warmup", time.perf_counter() - processed)
    return model.eval().requires_grad_(False)


def fp8_runs_on(device: torch.device) -> bool:
    """Whether FP8 block weights stay FP8 on `device`: CUDA with FP8 tensor cores (SM89+) and
    Triton for the decode-sized GEMMs. Elsewhere they are dequantised at load."""
    if device.type != "cuda" or not triton_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def load_weights(
    model: DeepseekForCausalLM,
    path: Path,
    index: dict[str, IndexEntry] | None = None,
    *,
    tp: TensorParallel = NO_TP,
    staged: bool = True,
    threads: int = DEFAULT_READER_THREADS,
) -> ReadStats:
    """Hand every checkpoint tensor to its parameter's weight loader as a `CheckpointTensor`
    (read: only the slice that loader keeps); raise on anything missing or wrong. Logs and
    returns this rank's bytes read and time. `staged` (default): memory-mapped files, `threads`
    readers, pinned staging on CUDA (`weight_stager.py`); off: one thread through `safe_open`
    and pageable copies (the path before; bench/weight_load.py compares the two)."""
    index = index_checkpoint(path) if index is None else index
    config = model.config
    params = dict(model.named_parameters())
    routes: dict[str, _Route] = {}
    required: dict[str, tuple[list[str], str | None]] = {}
    for name in params:
        if name.endswith("_scale_inv"):  # FP8 block scales: written by their weight's loader
            continue
        keys, fused = _checkpoint_keys(name, config)
        required[name] = ([key for key, _ in keys], fused)
        routes.update({key: _Route(name, kwargs) for key, kwargs in keys})
        if fused is not None:
            routes[fused] = _Route(name, {})

    scales = _fp8_scale_keys(index, config, path)  # FP8 weight key -> its scale's key
    consumed = set(scales.values())
    loaded: set[str] = set()
    unexpected: list[str] = []
    stats = ReadStats()
    device = next(iter(params.values())).device if params else torch.device("cpu")
    stager = WeightStager(device) if staged and device.type == "cuda" else None
    # Staged: the mapped files (zero-copy views), several readers at once; else safe_open.
    opener = CheckpointFile if staged else partial(safe_open, framework="pt", device="cpu")
    pool = ThreadPoolExecutor(max(1, threads), "weight-reader") if staged and threads > 1 else None
    start = time.perf_counter()
    files = sorted({entry.file for entry in index.values()})
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(file: Path) -> Any:  # every file opened once (a scale may live in another)
            if file not in handles:
                handles[file] = stack.enter_context(opener(file))
            return handles[file]

        def load_one(job: tuple[str, Path, _Route, CheckpointTensor]) -> str:
            key, file, route, tensor = job
            param = params[route.param_name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            # the reader threads place tensors on the model's device (a TP rank's own GPU)
            with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                try:
                    loader(param, tensor, **route.kwargs)
                except ValueError as e:
                    raise WeightLoadError(f"{key} in {file.name}: {e}") from None
            return key

        try:
            for shard, file in enumerate(files, 1):
                # Progress per shard, as vLLM shows it: a 671B checkpoint is 163 files, minutes.
                logger.info("loading weights: shard %d/%d (%s)", shard, len(files), file.name)
                jobs = []
                for key in handle(file).keys():  # noqa: SIM118 (safe_open is not a dict)
                    if key in consumed:
                        continue
                    route = routes.get(key)
                    if route is None:
                        unexpected.append(key)
                        continue
                    entry = index[key]
                    if entry.dtype not in _FLOAT_DTYPES and entry.dtype != _FP8_DTYPE:
                        raise WeightLoadError(f"{key}: unsupported weight dtype {entry.dtype}")
                    scale, scale_key = None, ""
                    if entry.dtype == _FP8_DTYPE:
                        scale_key = scales[key]
                        _check_block_scale(index, scale_key, entry.shape)
                        scale = handle(index[scale_key].file).get_slice(scale_key)
                    tensor = CheckpointTensor(
                        handle(file).get_slice(key),
                        entry.shape,
                        name=key,
                        scale=scale,
                        scale_name=scale_key,
                        # a layer that keeps FP8 takes weight and scale; elsewhere (CPU,
                        # kv_b_proj, eh_proj) the slice it reads is dequantised
                        dequantize=params[route.param_name].dtype != FP8_DTYPE,
                        stats=stats,
                        stager=stager,
                    )
                    jobs.append((key, file, route, tensor))
                loaded.update(map(load_one, jobs) if pool is None else pool.map(load_one, jobs))
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
            if stager is not None:
                stager.close()
    stats.seconds = time.perf_counter() - start
    logger.info(
        "weights: rank %d/%d read %.2f GB of the checkpoint in %.2f s (%.2f GB/s, %d reads, %s)",
        tp.rank, tp.size, stats.bytes / 1e9, stats.seconds, stats.gb_per_s, stats.reads,
        f"staged, {threads} readers" if staged else "safe_open",
    )  # fmt: skip

    for name, source in _MTP_TIED.items():
        if name in required and not set(required[name][0]) & loaded:
            del required[name]
            owner, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(owner), attr, model.get_parameter(source))
    missing = [
        key
        for keys, fused in required.values()
        if fused not in loaded
        for key in keys
        if key not in loaded
    ]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 8 else ""
        )
        raise WeightLoadError(f"checkpoint {path} is missing weights: {shown}")
    extra = [k for k in unexpected if not _is_ignorable(k, config)]
    if extra:
        logger.warning("ignoring %d unexpected checkpoint tensors, e.g. %s", len(extra), extra[:5])
    return stats


def _checkpoint_keys(name: str, config: ModelConfig) -> tuple[list[tuple[str, dict]], str | None]:
    """Parameter name -> ([(checkpoint key, weight_loader kwargs)], fused alternative key)."""
    hf = _hf_name(name, config)
    if hf.endswith("experts.gate_up_proj") or hf.endswith("experts.down_proj"):
        base, proj = hf.rsplit(".", 1)
        projs = ["gate_proj", "up_proj"] if proj == "gate_up_proj" else ["down_proj"]
        keys = [
            (
                f"{base}.{e}.{p}.weight",
                {"expert_id": e} | ({"shard_id": s} if len(projs) > 1 else {}),
            )
            for e in range(config.n_routed_experts or 0)
            for s, p in enumerate(projs)
        ]
        return keys, hf
    if hf.endswith("fused_qkv_a_proj_with_mqa.weight"):
        base = hf.removesuffix("fused_qkv_a_proj_with_mqa.weight")
        q = "q_a_proj" if config.q_lora_rank is not None else "q_proj"
        return [
            (f"{base}{q}.weight", {"shard_id": 0}),
            (f"{base}kv_a_proj_with_mqa.weight", {"shard_id": 1}),
        ], None
    if hf.endswith("gate_up_proj.weight"):
        base = hf.removesuffix("gate_up_proj.weight")
        return [
            (f"{base}gate_proj.weight", {"shard_id": 0}),
            (f"{base}up_proj.weight", {"shard_id": 1}),
        ], None
    return [(hf, {})], None


def _fp8_scale_keys(
    index: dict[str, IndexEntry], config: ModelConfig, path: Path
) -> dict[str, str]:
    """Every F8_E4M3 tensor's block-scale key (`X.weight_scale_inv` or `X.scale`)."""
    fp8 = [key for key, entry in index.items() if entry.dtype == _FP8_DTYPE]
    if not fp8:
        return {}
    if config.quantization is None:
        raise WeightLoadError(
            f"{path}: {fp8[0]} is {_FP8_DTYPE} but config.json declares no quantization_config "
            "(FP8 block-quantized weights need quant_method 'fp8' with weight_block_size "
            "[128, 128])"
        )
    scales: dict[str, str] = {}
    for key in fp8:
        if not key.endswith(".weight"):
            raise WeightLoadError(f"{key}: only linear weights (*.weight) may be FP8")
        base = key.removesuffix("weight")
        candidates = [base + suffix for suffix in _SCALE_SUFFIXES]
        found = [c for c in candidates if c in index]
        if not found:
            raise WeightLoadError(
                f"{key}: FP8 weight has no block scale (expected {candidates[0]} or "
                f"{candidates[1]})"
            )
        scales[key] = found[0]
    return scales


def _check_block_scale(
    index: dict[str, IndexEntry], key: str, weight_shape: tuple[int, ...]
) -> None:
    """The block scale `key` of a weight of `weight_shape`, checked from the header: float,
    shape [ceil(N/128), ceil(K/128)]. Its values are checked where a rank reads them
    (`CheckpointTensor`)."""
    entry = index[key]
    if entry.dtype not in _FLOAT_DTYPES:
        raise WeightLoadError(f"{key}: block scale must be a float tensor, got dtype {entry.dtype}")
    if len(weight_shape) != 2:
        raise WeightLoadError(f"{key}: block scales need a 2-D weight, got {list(weight_shape)}")
    n, k = weight_shape
    expected = [-(-n // 128), -(-k // 128)]
    if list(entry.shape) != expected:
        raise WeightLoadError(
            f"{key}: block scale shape {list(entry.shape)} does not match the weight's "
            f"{list(weight_shape)} in 128x128 blocks (expected {expected})"
        )


def _hf_name(name: str, config: ModelConfig) -> str:
    if not name.startswith("mtp."):
        return name
    layer = f"model.layers.{config.num_hidden_layers}."
    rest = name.removeprefix("mtp.")
    return layer + rest.removeprefix("block.")


def load_kv_scales(model_config: ModelConfig, path: str | Path) -> list[float] | None:
    """Per-layer latent KV-cache scales from the checkpoint, or None if it has none.
    Layers without one get 1.0."""
    path = Path(path)
    found: dict[int, float] = {}
    for key, (file, _, _) in index_checkpoint(path).items():
        m = _KV_SCALE_KEY.match(key)
        if m and int(m.group(1)) < model_config.num_hidden_layers:
            with safe_open(file, framework="pt", device="cpu") as f:
                value = float(f.get_tensor(key).float().reshape(-1)[0])
            if not value > 0:
                raise WeightLoadError(f"{key}: KV scale must be positive, got {value}")
            found[int(m.group(1))] = value
    if not found:
        return None
    return [found.get(i, 1.0) for i in range(model_config.num_hidden_layers)]


def _is_ignorable(key: str, config: ModelConfig) -> bool:
    """Tensors we knowingly skip: rotary caches, KV-cache scales (read by `load_kv_scales`), and
    layers past the ones we build (extra MTP depths, or MTP weights when the config has none)."""
    if key.endswith("rotary_emb.inv_freq") or _KV_SCALE_KEY.match(key):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", key)
    return m is not None and int(m.group(1)) >= config.num_hidden_layers
