"""TensorRT-LLM's trtllm-gen MLA kernels on Blackwell (SM100/103), from `flashinfer-python`.

NEVER RUN ON A B200: every call below is checked on a CPU against the installed package's real
signatures and validators (`tests/kernels_adapter/test_blackwell_contract.py`).

Decode / verify (`flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`, 0.7.2.post1,
defined in `flashinfer.mla._core`), called with `backend="trtllm-gen"`: its precompiled cubins,
never the CuTe DSL path that "auto" may pick (which compiles per shape at first use). H is the
heads of this tensor-parallel rank (`num_heads`; DeepSeek-V3 128 / 64 / 32 / 16 at TP 1/2/4/8):

    query        [bs, q_len, H, 576], bf16 for a bf16 cache, float8_e4m3fn for an fp8 cache
                 (cast unscaled: MLA has no bf16-query / fp8-cache mode); H <= 64 or H == 128
                 (per rank), q_len <= 8
    kv_cache     [num_pages, 1, page_size, 576], the pool's tensor with a head axis (a view)
    block_tables [bs, W] int32; W a multiple of 128 / page_size (the check "auto" and cute-dsl
                 make; trtllm-gen takes any W, but a padded table keeps both valid). When the
                 runner's width is not such a multiple, `prepare` copies the rows into a table
                 allocated once here at [max_num_seqs, W_padded] (pad columns = page 0)
    seq_lens     [bs] int32, KV length including this step's q_len tokens (causal among them)
    max_seq_len  host int = max_model_len, the capture bound: no device read, stable graphs
    bmm1_scale   Python float k_scale * model softmax_scale (float = static for capture; the
                 tensor form allocates a log2e product per call)
    bmm2_scale   Python float k_scale (value = stored * k_scale, and V is the latent)
    workspace    1-D uint8, zero-initialised once (it holds multi-CTA semaphores), 150 MiB
    multi_ctas_kv_counter_buffer  zero-initialised once, sized by flashinfer's
                 get_trtllm_gen_multi_ctas_kv_counter_bytes(max_num_seqs, H, num_sms), H per
                 rank; the
                 kernel resets it after each launch (else it is allocated lazily per call)
    returns      [bs, q_len, H, 512] bf16

Prefill (EXTEND) runs in the MHA form (`mha_extend.py`) through flashinfer's ragged DeepSeek
kernel `flashinfer.prefill.trtllm_ragged_attention_deepseek` (trtllm-gen): its API fits the MHA
form exactly (Q [T, H, 192], K [S, H, 192], V [S, H, 128], cum_seq_lens_q / cum_seq_lens_kv,
causal), bf16 or fp8 like the cache, bf16 output. Assumption the B200 test must confirm: its
causal mask is bottom-right aligned when a sequence has more keys than queries (chunked prefill
over a cached prefix), as trtllm-gen's context kernels are in TensorRT-LLM.

Cubins: flashinfer downloads the trtllm-gen cubins from NVIDIA's artifactory at first use
unless they are on disk. An offline deployment must provide them: `flashinfer download-kernels`
(installs the flashinfer-cubin and flashinfer-jit-cache wheels matching the installed flashinfer;
PyPI's flashinfer-cubin stops at 0.6.13, which 0.7.2.post1 ignores as mismatched), or
`FLASHINFER_CUBIN_DIR=DIR flashinfer download-cubin` on a machine with network, then ship DIR and
set FLASHINFER_CUBIN_DIR=DIR (without flashinfer-jit-cache, flashinfer also builds its `fmha_gen`
launcher with nvcc at first use). The backend checks the files at construction (`missing_cubins`)
and refuses to start without them, rather than failing (or waiting on the network) at the first
request.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from mlaserve.kernels_adapter.base import BackendUnsupportedError, per_rank_heads
from mlaserve.kernels_adapter.blackwell import BlackwellBackend, latent_dims_problem
from mlaserve.kernels_adapter.gpu_target import GpuTarget
from mlaserve.kernels_adapter.mha_extend import ExtendLayout, extend_layout, mha_context_kv
from mlaserve.kv_cache.kv_pool import FP8_E4M3_MAX

if TYPE_CHECKING:
    from mlaserve.config import ModelConfig
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["TrtllmBackend", "missing_cubins", "padded_table_width"]

CAPABILITIES = ((10, 0), (10, 3))
PAGE_SIZES = (32, 64)  # trtllm-gen: "requires block_size in (32, 64)"
KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
# (d_n + d_r, d_v) the ragged prefill takes: DeepSeek-R1/V3, "smaller" MLA, GLM-5.
PREFILL_DIMS = ((192, 128), (128, 128), (256, 256))
# SGLang's value (128 MB in 2025, 150 MB since): flashinfer has no size function for the
# trtllm-gen decode/prefill workspace (split-KV partials and multi-CTA semaphores); vLLM uses
# 128 MB, TokenSpeed 256 MB. One buffer, zeroed once, shared by decode and prefill calls,
# which run in order on one stream.
WORKSPACE_BYTES = 150 * 1024 * 1024


def padded_table_width(max_model_len: int, page_size: int) -> int:
    """Page-table columns covering max_model_len, rounded up to a multiple of 128 / page_size."""
    multiple = 128 // page_size
    pages = -(-max_model_len // page_size)
    return -(-pages // multiple) * multiple


def _import_flashinfer():
    try:
        from flashinfer.mla import _core
        from flashinfer.prefill import trtllm_ragged_attention_deepseek
        from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes
    except ImportError as e:
        raise BackendUnsupportedError(
            "attention_backend 'trtllm' needs the flashinfer-python package "
            f"(pip install 'mlaserve[blackwell]'): {e}"
        ) from None
    return (
        _core.trtllm_batch_decode_with_kv_cache_mla,
        trtllm_ragged_attention_deepseek,
        (get_trtllm_gen_multi_ctas_kv_counter_bytes),
    )


def missing_cubins(cubin_dir: Path | None = None) -> str | None:
    """Why the trtllm-gen FMHA cubins are not usable offline, or None when they are all on disk.

    Checks, without network: the pinned `checksums.txt` of flashinfer's trtllm-gen FMHA artifact
    (by its sha256), the `flashInferMetaInfo.h` header it names, and that every file it lists is
    present. `cubin_dir`: default flashinfer's FLASHINFER_CUBIN_DIR (env var, flashinfer-cubin
    package, or ~/.cache/flashinfer/cubins)."""
    import hashlib

    from flashinfer.artifacts import ArtifactPath, CheckSumHash
    from flashinfer.jit.env import FLASHINFER_CUBIN_DIR

    root = Path(cubin_dir) if cubin_dir is not None else FLASHINFER_CUBIN_DIR
    fmha = root / ArtifactPath.TRTLLM_GEN_FMHA
    hint = (
        "offline hosts need them on disk: `flashinfer download-kernels` (flashinfer-cubin wheel "
        "matching flashinfer-python), or `FLASHINFER_CUBIN_DIR=DIR flashinfer download-cubin` "
        "with network, then ship DIR and set FLASHINFER_CUBIN_DIR=DIR"
    )
    manifest = fmha / "checksums.txt"
    if not manifest.is_file():
        return f"no trtllm-gen cubins at {fmha} ({hint})"
    data = manifest.read_bytes()
    if hashlib.sha256(data).hexdigest() != CheckSumHash.TRTLLM_GEN_FMHA:
        return f"{manifest} is not the manifest flashinfer pins ({hint})"
    names = [line.split()[1] for line in data.decode().splitlines() if line.strip()]
    missing = [n for n in names if not (fmha / n).is_file()]
    if missing:
        return f"{len(missing)} of {len(names)} trtllm-gen cubins missing under {fmha}, e.g. {missing[0]} ({hint})"
    return None


def _cast_like_cache(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    if kv_dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(kv_dtype).contiguous()


@dataclass
class _DecodeMetadata:
    block_tables: torch.Tensor  # [bs, W] int32, W a multiple of 128 / page_size


class TrtllmBackend(BlackwellBackend):
    name: ClassVar[str] = "trtllm"
    # MTP verify shapes (SGLang runs its verify through this kernel); larger is untested.
    max_uniform_q_len: ClassVar[int] = 8

    @classmethod
    def check_target(
        cls,
        model_config: ModelConfig,
        page_size: int,
        kv_cache_dtype: torch.dtype,
        target: GpuTarget,
        *,
        num_heads: int | None = None,
        max_q_len: int = 1,
    ) -> None:
        """`check_supported` for a described GPU (works without one), with `num_heads` heads a
        rank (None: all, TP1) and up to `max_q_len` tokens per sequence."""
        mc = model_config
        heads = per_rank_heads(mc, num_heads)
        problem = None
        if target.capability not in CAPABILITIES:
            problem = f"trtllm-gen kernels are SM100/SM103 only, got {target.sm_name}"
        elif page_size not in PAGE_SIZES:
            problem = f"page_size must be 32 or 64, got {page_size}"
        elif kv_cache_dtype not in KV_DTYPES:
            problem = f"kv_cache_dtype must be bf16 or fp8_e4m3, got {kv_cache_dtype}"
        elif dims := latent_dims_problem(mc):
            problem = dims
        elif not (heads <= 64 or heads == 128):
            problem = (
                f"heads per rank (num_attention_heads {mc.num_attention_heads} / tensor-parallel "
                f"size) must be <= 64 or exactly 128, got {heads}"
            )
        elif (mc.qk_head_dim, mc.v_head_dim) not in PREFILL_DIMS:
            problem = (
                "qk_nope_head_dim + qk_rope_head_dim / v_head_dim must be one of "
                f"{PREFILL_DIMS} for the ragged prefill, got {mc.qk_head_dim}/{mc.v_head_dim}"
            )
        if problem:
            raise BackendUnsupportedError(f"attention_backend 'trtllm': {problem}")
        cls.check_shape(mc, heads, max_q_len)
        _import_flashinfer()

    def _init_kernels(self) -> None:
        self._decode, self._prefill, counter_bytes = _import_flashinfer()
        if self.on_gpu:
            problem = missing_cubins()
            if problem:
                raise BackendUnsupportedError(f"attention_backend 'trtllm': {problem}")
            # Build (nvcc, unless flashinfer-jit-cache has it) and load the trtllm-gen launcher
            # now: a failure belongs at start-up, not in the first request.
            from flashinfer.mla._core import get_trtllm_gen_fmha_module

            try:
                get_trtllm_gen_fmha_module()
            except Exception as e:
                raise BackendUnsupportedError(
                    f"attention_backend 'trtllm': cannot load flashinfer's trtllm-gen module: {e}"
                ) from e
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.kv_counter = torch.zeros(  # for this rank's heads
            counter_bytes(self.max_num_seqs, self.num_heads, self.target.num_sms),
            dtype=torch.uint8,
            device=self.device,
        )
        self.table_width = padded_table_width(self.max_model_len, self.page_size)
        # Allocated once; rows are overwritten per forward only when the runner's width is not
        # already a multiple of 128 / page_size. Pad columns stay 0 (the dummy page).
        self._tables = torch.zeros(
            self.max_num_seqs, self.table_width, dtype=torch.int32, device=self.device
        )

    # -- metadata ---------------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch) -> None:
        if not batch.mode.is_uniform:
            batch.attn_metadata = extend_layout(batch)  # host lengths; shared by all layers
            return
        self.check_uniform_bounds(batch)
        tables = batch.block_tables
        width = tables.shape[1]
        if width % (128 // self.page_size) == 0 and tables.is_contiguous():
            batch.attn_metadata = _DecodeMetadata(block_tables=tables)
            return
        if width > self.table_width:
            raise ValueError(
                f"block_tables: {width} columns, more than max_model_len needs "
                f"({self.table_width} padded)"
            )
        self._tables[: batch.bs, :width].copy_(tables)  # device copy, capturable
        batch.attn_metadata = _DecodeMetadata(block_tables=self._tables[: batch.bs])

    # -- decode / verify --------------------------------------------------------------------

    def decode_kwargs(
        self, layer_id: int, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch
    ) -> dict[str, Any]:
        """The exact keyword arguments of `trtllm_batch_decode_with_kv_cache_mla`: q_nope
        [T, H, 512], q_pe [T, H, 64] with H this rank's heads, T = bs * q_len."""
        self.check_heads(q_nope, "q_nope")
        self.check_heads(q_pe, "q_pe")
        meta: _DecodeMetadata = batch.attn_metadata
        pool = batch.kv_pool
        k_scale = float(pool.k_scales[layer_id])
        q = torch.cat([q_nope, q_pe], dim=-1).view(batch.bs, batch.q_len, self.num_heads, -1)
        return {
            "query": _cast_like_cache(q, self.kv_cache_dtype),
            "kv_cache": pool.kv_buffers[layer_id].unsqueeze(1),
            "workspace_buffer": self.workspace,
            "qk_nope_head_dim": self.model_config.qk_nope_head_dim,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "block_tables": meta.block_tables,
            "seq_lens": batch.seq_lens,
            "max_seq_len": self.max_model_len,
            "bmm1_scale": k_scale * self.softmax_scale,
            "bmm2_scale": k_scale,
            "backend": "trtllm-gen",
            "multi_ctas_kv_counter_buffer": self.kv_counter,
        }

    def forward(
        self,
        layer_id: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        if not batch.mode.is_uniform:
            raise NotImplementedError(
                "trtllm: EXTEND batches take the MHA form (forward_extend_mha)"
            )
        batch.kv_pool.write(layer_id, batch.slot_mapping, kv_c, k_pe)
        out = self._decode(**self.decode_kwargs(layer_id, q_nope, q_pe, batch))
        num_tokens, num_heads, rank = q_nope.shape
        return out.reshape(num_tokens, num_heads, rank).to(q_nope.dtype)

    # -- prefill (MHA form) -----------------------------------------------------------------

    def prefill_kwargs(
        self,
        layer_id: int,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        batch: ForwardBatch,
    ) -> dict[str, Any]:
        """Writes the new latent KV, then returns the exact keyword arguments of
        `trtllm_ragged_attention_deepseek` over every sequence's whole context. q [T, H, 192],
        w_uk [H, 128, 512], w_uv [H, 512, 128]: this rank's heads."""
        self.check_mha_heads(q, w_uk, w_uv)
        layout: ExtendLayout = batch.attn_metadata
        _, k, v = mha_context_kv(layer_id, kv_c, k_pe, w_uk, w_uv, batch, layout)
        return {
            "query": _cast_like_cache(q, self.kv_cache_dtype),
            "key": _cast_like_cache(k, self.kv_cache_dtype),
            "value": _cast_like_cache(v, self.kv_cache_dtype),
            "workspace_buffer": self.workspace,
            "seq_lens": layout.kv_lens_dev,
            "max_q_len": layout.max_q_len,
            "max_kv_len": layout.max_kv_len,
            # K and V come from the dequantized latent, cast unscaled: no k/v scale to fold.
            "bmm1_scale": self.softmax_scale,
            "bmm2_scale": 1.0,
            "o_sf_scale": 1.0,
            "batch_size": layout.bs,
            "window_left": -1,
            "cum_seq_lens_q": layout.cu_q,
            "cum_seq_lens_kv": layout.cu_kv,
            "enable_pdl": None,
            "is_causal": True,
            "return_lse": False,
            "backend": "trtllm-gen",
        }

    def forward_extend_mha(
        self,
        layer_id: int,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        out = self._prefill(**self.prefill_kwargs(layer_id, q, kv_c, k_pe, w_uk, w_uv, batch))
        return out.to(q.dtype)  # [T, H, d_v] bf16 -> model dtype
