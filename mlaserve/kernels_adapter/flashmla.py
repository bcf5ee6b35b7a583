"""FlashMLA dense decode on Hopper (SM90), from the `sgl-flash-mla` package (`import flash_mla`).

Kernel boundary (sgl-flash-mla 1.0.0, its legacy SM90 half, `use_legacy=True`), with H the
heads of this tensor-parallel rank (`num_heads`; DeepSeek-V3 128 / 64 / 32 / 16 at TP 1/2/4/8):

    q        [bs, q_len, H, 576]  bf16 (bf16 cache) | float8_e4m3fn (fp8 cache, + descale_q)
    k_cache  [num_pages, 64, 1, 576]  the pool's [num_pages, page_size, 576] with a head axis
    block_table [bs, max_pages] int32; cache_seqlens [bs] int32 (KV length incl. new tokens)
    out      [bs, q_len, H, 512] bf16; causal among the q_len new tokens
    fp8: descale_q / descale_k are fp32 [1] tensors (value = stored * descale); the cache is the
         plain 576-byte e4m3 layout of `kv_cache/kv_pool.py`, no inline scales.

The split-KV schedule depends on the `cache_seqlens` values, so `prepare()` recomputes it every
forward with `get_mla_decoding_metadata` — a kernel on the current stream, which a CUDA graph
captures and re-runs on replay. One schedule per forward, shared by all layers; it is built for
q_len * H query rows per KV head, H per rank. The adapter has no head-count limit of its own
(only q_len <= 8); the split-KV workspace of the Triton small-batch kernel is sized for H per
rank at construction.

Only uniform batches (DECODE / VERIFY / DRAFT_EXTEND, q_len <= 8) use the kernel: the batch's stated
mode decides, never its shapes. Those of at most `small_batch_max_rows(H)` token rows (bs * q_len, a
host int fixed per captured graph: 4 for 16 heads a rank, 1 from 64, unless
`MLASERVE_MLA_DECODE_ROWS` says otherwise) go to the Triton split-KV kernel of `ops/mla_decode.py`
instead. With fused ops the others take a joined query (`joined_q_dtype`, `forward_joined`): at
decode sizes the layer's W_UK GEMV writes q in the kernel's dtype itself, so `ops/q_prep.py` does
not run (`MLASERVE_JOINED_Q=0`: it does, for A/B runs). EXTEND batches (prefill chunks) run in the
MHA form of `mha_extend.py` (`forward_extend_mha`): each sequence's cached latent context is
dequantised and up-projected to per-head bf16 K [S, H, 192] / V [S, H, 128], then one causal varlen
FlashAttention-2 launch per layer (`flash_varlen.py`, torch's own kernels) attends the whole ragged
batch, bottom-right aligned, so chunks over a cached prefix stay exact. Batches of a few fresh
prompts (no cached prefix) go to cuDNN's SDPA instead (`cudnn_fresh.py`), which is faster where its
top-left causal mask is the right one. Unless `MLASERVE_ABSORBED_HIT=0`, an EXTEND batch of one
sequence with a few new tokens over a long cached prefix (`absorbed_hit.py`) is attended by FlashMLA
itself instead, as a causal q_len of up to 128 tokens: W_UK and W_UV run on its new tokens only,
inside `forward_extend_mha`, so the model and the piecewise graphs see the MHA form's contract
either way.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar

import torch

from mlaserve import switches
from mlaserve.kernels_adapter.absorbed_hit import takes_absorbed_hit
from mlaserve.kernels_adapter.base import AttentionBackend, BackendUnsupportedError
from mlaserve.kernels_adapter.cudnn_fresh import CudnnFreshAttention
from mlaserve.kernels_adapter.flash_varlen import FlashVarlenAttention, flash_varlen_available
from mlaserve.kernels_adapter.mha_extend import ExtendLayout, extend_layout, mha_context_kv
from mlaserve.kv_cache.kv_pool import FP8_E4M3_MAX
from mlaserve.ops import fused_ops_enabled

if TYPE_CHECKING:
    from mlaserve.config import ModelConfig
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["FlashMLABackend", "flashmla_available"]

PAGE_SIZE = 64
# FlashMLA's fixed cost per layer (its split kernel and combine, plus a schedule kernel per
# forward) dwarfs the KV bytes of a few sequences; see `small_batch_max_rows`. 4 rows covers a
# bs-1 VERIFY or DRAFT_EXTEND with k = 3 and a bs-4 decode (bench/mla_decode.py, bench/RESULTS.md).
SMALL_BATCH_MAX_ROWS = 4
# ... of at most this many query rows (tokens x heads a rank): the Triton kernel's key loop is
# not pipelined, so with V3's 64 heads a rank it loses to FlashMLA from 2 tokens (bench/RESULTS.md,
# thirty-third session); one token always takes it.
SMALL_BATCH_QUERY_ROWS = 64
KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def flashmla_available() -> bool:
    """Whether this machine has what the backend needs beyond the model's shape: an SM90 GPU and
    the flash_mla package (`check_supported` says which constraint fails, and why)."""
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and importlib.util.find_spec("flash_mla") is not None
    )


def _import_flash_mla():
    try:
        import flash_mla
    except ImportError as e:
        raise BackendUnsupportedError(
            "attention_backend 'flashmla' needs the sgl-flash-mla package "
            f"(pip install 'mlaserve[hopper]'): {e}"
        ) from None
    if not flash_mla.has_legacy():
        raise BackendUnsupportedError(
            "attention_backend 'flashmla': this sgl-flash-mla build has no legacy SM90 kernels"
        )
    return flash_mla


@dataclass
class _Metadata:
    sched: object  # flash_mla.FlashMLASchedMeta with the schedule filled in


class _SmallBatch:
    """Metadata of a forward that `ops/mla_decode.py` attends (nothing to precompute)."""


@dataclass
class _AbsorbedHit:
    """Metadata of an EXTEND batch FlashMLA attends in the absorbed form (`absorbed_hit.py`):
    one sequence, `q_len` new tokens, its schedule built for q_len x H query rows."""

    sched: object
    q_len: int


def small_batch_max_rows(num_heads: int) -> int:
    """Uniform forwards of at most this many token rows (bs * q_len) of `num_heads` heads (per
    rank) take the Triton kernel of `ops/mla_decode.py` instead of FlashMLA: SMALL_BATCH_MAX_ROWS,
    fewer where they would pass SMALL_BATCH_QUERY_ROWS query rows, at least 1 (4 for 16 heads,
    2 for 32, 1 for 64 or more; bench/mla_decode.py measures the crossover).
    `MLASERVE_MLA_DECODE_ROWS` overrides it for A/B runs (0: FlashMLA always)."""
    by_heads = max(1, SMALL_BATCH_QUERY_ROWS // max(1, num_heads))
    return switches.mla_decode_rows(min(SMALL_BATCH_MAX_ROWS, by_heads))


class FlashMLABackend(AttentionBackend):
    name: ClassVar[str] = "flashmla"
    supports_cuda_graph: ClassVar[bool] = True
    # FlashMLA's split schedule packs q_len * heads query rows per KV head; sglang and vLLM use
    # it for MTP verify up to a handful of tokens. A 1000-token "decode" trips its metadata
    # assertion (flash_fwd_mla_metadata.cu:64), which is why EXTEND never reaches it.
    max_uniform_q_len: ClassVar[int] = 8
    mha_extend: ClassVar[bool] = True
    # cuDNN on one sequence of the bucket's rows (or FA2 on fixed cu_seqlens): fixed shapes
    captures_fresh_extend: ClassVar[bool] = True
    accepts_written_kv: ClassVar[bool] = True  # decode only: EXTEND writes in forward_extend_mha

    @classmethod
    def check_supported(
        cls,
        model_config: ModelConfig,
        page_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        *,
        num_heads: int | None = None,
        max_q_len: int = 1,
    ) -> None:
        """`num_heads` heads a rank (None: all, TP1), up to `max_q_len` tokens per sequence."""
        cls.check_shape(model_config, num_heads, max_q_len)  # on any device
        problem = None
        if device.type != "cuda":
            problem = f"needs a CUDA device, got {device}"
        elif torch.cuda.get_device_capability(device) != (9, 0):
            cap = torch.cuda.get_device_capability(device)
            problem = (
                f"its dense decode kernels are SM90 (Hopper) only, this GPU is SM{cap[0]}{cap[1]}"
            )
        elif page_size != PAGE_SIZE:
            problem = f"page_size must be {PAGE_SIZE}, got {page_size}"
        elif kv_cache_dtype not in KV_DTYPES:
            problem = f"kv_cache_dtype must be bf16 or fp8_e4m3, got {kv_cache_dtype}"
        elif (model_config.kv_lora_rank, model_config.qk_rope_head_dim) != (512, 64):
            problem = (
                "kv_lora_rank/qk_rope_head_dim must be 512/64, got "
                f"{model_config.kv_lora_rank}/{model_config.qk_rope_head_dim}"
            )
        elif not flash_varlen_available(device):
            problem = (
                "its prefill path needs torch's FlashAttention-2 kernels (this build has none)"
            )
        if problem:
            raise BackendUnsupportedError(f"attention_backend 'flashmla': {problem}")
        _import_flash_mla()

    def __init__(self, model_config: ModelConfig, *args, **kwargs) -> None:
        super().__init__(model_config, *args, **kwargs)
        self._flash_mla = _import_flash_mla()
        self.is_fp8 = self.kv_cache_dtype == torch.float8_e4m3fn
        # q enters the fp8 kernel unscaled (|q| is far below e4m3's 448 for real models), so its
        # descale is 1; the latent cache's own scale comes from the pool per layer.
        self._q_descale = torch.ones(1, dtype=torch.float32, device=self.device)
        fused = fused_ops_enabled(self.device)
        qk_dim = model_config.qk_nope_head_dim + model_config.qk_rope_head_dim
        merge_shape = (self.num_heads, qk_dim, model_config.v_head_dim) if fused else None
        self._prefill = FlashVarlenAttention(self.device, fused_merge_shape=merge_shape)
        self._prefill_fresh = CudnnFreshAttention(self.device)
        self._q_dtype = torch.float8_e4m3fn if self.is_fp8 else torch.bfloat16
        # cat + clamp + cast of the query in one Triton kernel (`mlaserve/ops/q_prep.py`).
        self._prepare_q = None
        # With fused ops, decode-sized layers hand over the query W_UK's GEMV wrote whole
        # (`joined_q_dtype`); `MLASERVE_JOINED_Q=0` turns that off for A/B runs.
        self._joined_q = False
        # Small uniform batches: the split-KV Triton kernel (`ops/mla_decode.py`), which reads
        # q_nope and q_pe as they are (no q preparation) and needs no schedule.
        self._small_rows = 0
        # Prefill's per-head keys [k_nope | k_pe] by one Triton copy (`ops/mha_key.py`), its
        # fp8 context latent gathered and dequantised by one launch (`ops/kv_gather.py`).
        self._mha_key = self._gather_dequant = None
        # A prefix-cache hit as a decode of its new tokens (`absorbed_hit.py`), when switched on.
        self._absorbed_hit = switches.absorbed_hit() and self.device.type == "cuda"
        self._num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self._absorbed_hit
            else 0
        )
        if fused:
            from mlaserve.ops.kv_gather import gather_dequant
            from mlaserve.ops.mha_key import mha_key
            from mlaserve.ops.mla_decode import MlaDecodeWorkspace, mla_decode
            from mlaserve.ops.q_prep import prepare_q

            self._prepare_q, self._mha_key = prepare_q, mha_key
            self._gather_dequant = gather_dequant
            self._joined_q = switches.joined_q()
            self._small_rows = small_batch_max_rows(self.num_heads)
            if self._small_rows > 0:
                self._mla_decode = mla_decode
                self._workspace = MlaDecodeWorkspace(  # once for every small batch, per rank
                    self._small_rows,
                    self.max_q_len,
                    self.num_heads,
                    self.kv_lora_rank,
                    self.device,
                )

    def warm_up_tasks(self, act_dtype: torch.dtype) -> list[Callable[[], None]]:
        """The prefill path's fused merge (`FlashVarlenAttention.warm_up_tasks`); with fused ops
        also the MHA prefill's key assembly and latent gather, the query's preparation and a
        task per variant of the small-batch decode kernel. Each on tensors of its own (a page,
        a workspace): they run beside the engine's forwards (`model/kernel_warm_up.py`)."""
        tasks = self._prefill.warm_up_tasks()
        if self._mha_key is None:
            return tasks
        tasks += [partial(self._warm_up_prefill, act_dtype), partial(self._warm_up_q, act_dtype)]
        if self._small_rows > 0:
            from mlaserve.ops.mla_decode import MlaDecodeWorkspace, mla_decode_warm_up_tasks

            page = torch.zeros(
                1, self.page_size, self.kv_lora_rank + self.qk_rope_head_dim,
                dtype=self.kv_cache_dtype, device=self.device,
            )  # fmt: skip
            workspace = MlaDecodeWorkspace(
                self._small_rows, self.max_q_len, self.num_heads, self.kv_lora_rank, self.device
            )  # the same rows as the forwards' (they bound the splits: a variant's key)
            tasks += mla_decode_warm_up_tasks(
                page, torch.ones(1, device=self.device), self.num_heads, act_dtype,
                self._small_rows, self.max_q_len, max_rows=self._small_rows,
                rope_dim=self.qk_rope_head_dim, workspace=workspace,
            )  # fmt: skip
        return tasks

    def _warm_up_prefill(self, act_dtype: torch.dtype) -> None:
        """`forward_extend_mha`'s kernels on one context row laid out as the forward lays it
        (`mha_extend.mha_context_kv`): the fp8 latent's gather, the per-head keys."""
        r, d_r = self.kv_lora_rank, self.qk_rope_head_dim
        d_n, d_v = self.model_config.qk_nope_head_dim, self.model_config.v_head_dim
        if self.is_fp8:
            rows = torch.zeros(
                self.page_size, r + d_r, dtype=self.kv_cache_dtype, device=self.device
            )
            slots = torch.zeros(1, dtype=torch.int64, device=self.device)
            latent = self._gather_dequant(rows, slots, 1.0, act_dtype)
        else:
            latent = torch.zeros(1, r + d_r, dtype=act_dtype, device=self.device)
        kv = torch.zeros(1, self.num_heads * (d_n + d_v), dtype=act_dtype, device=self.device)
        self._mha_key(kv.view(1, self.num_heads, d_n + d_v), latent[:, r:], d_n)

    def _warm_up_q(self, act_dtype: torch.dtype) -> None:
        """`_join_query`'s kernel (FlashMLA's wider batches, the absorbed hit)."""
        shape = (1, self.num_heads)
        q_nope = torch.zeros(*shape, self.kv_lora_rank, dtype=act_dtype, device=self.device)
        q_pe = torch.zeros(*shape, self.qk_rope_head_dim, dtype=act_dtype, device=self.device)
        self._prepare_q(q_nope, q_pe, self._q_dtype)

    def attends_absorbed(self, q_lens: tuple[int, ...], seq_lens: tuple[int, ...]) -> bool:
        """Whether an EXTEND batch of these host lengths is attended in the absorbed form."""
        return self._absorbed_hit and takes_absorbed_hit(
            q_lens, seq_lens, self.num_heads, self._num_sms
        )

    def prepare(self, batch: ForwardBatch) -> None:
        if not batch.mode.is_uniform:
            if batch.q_lens_host is not None and self.attends_absorbed(
                tuple(batch.q_lens_host), tuple(batch.seq_lens_host or ())
            ):
                q_len = batch.q_lens_host[0]
                batch.attn_metadata = _AbsorbedHit(self._schedule(batch.seq_lens[:1], q_len), q_len)
                return
            batch.attn_metadata = extend_layout(batch)  # host lengths; shared by all layers
            return
        if batch.bs * batch.q_len <= self._small_rows:
            batch.attn_metadata = _SmallBatch()
            return
        batch.attn_metadata = _Metadata(sched=self._schedule(batch.seq_lens, batch.q_len))

    def _schedule(self, seq_lens: torch.Tensor, q_len: int) -> object:
        """FlashMLA's split-KV schedule for sequences of `seq_lens` [bs] int32 (device) keys and
        `q_len` new tokens each: a kernel on the current stream, one per forward."""
        fm = self._flash_mla
        sched, _ = fm.get_mla_metadata()  # a fresh schedule object for every forward
        sched.tile_scheduler_metadata, sched.num_splits = fm.get_mla_decoding_metadata(
            seq_lens,
            q_len * self.num_heads,  # query rows per KV head (MQA: one KV head)
            1,
            is_fp8_kvcache=self.is_fp8,
            use_legacy=True,
        )
        return sched

    def forward(
        self,
        layer_id: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor | None,
        k_pe: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        if not batch.mode.is_uniform:
            raise NotImplementedError(
                "flashmla: EXTEND batches take the MHA form (forward_extend_mha)"
            )
        self.check_heads(q_nope, "q_nope")
        self.check_heads(q_pe, "q_pe")
        pool = batch.kv_pool
        if kv_c is not None:  # else the layer has written it (`accepts_written_kv`)
            pool.write(layer_id, batch.slot_mapping, kv_c, k_pe)
        if isinstance(batch.attn_metadata, _SmallBatch):
            return self._mla_decode(
                q_nope,
                q_pe,
                pool.kv_buffers[layer_id],
                pool.k_scale_tensors[layer_id],
                batch.block_tables,
                batch.seq_lens,
                batch.q_len,
                self.softmax_scale,
                workspace=self._workspace,
            )
        return self._decode(layer_id, self._join_query(q_nope, q_pe), batch).to(q_nope.dtype)

    def _join_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[T, H, r] + [T, H, d_r] -> the kernel's query [T, H, r + d_r] in `self._q_dtype`
        (fp8: clamped to e4m3's range first)."""
        if self._prepare_q is not None:
            return self._prepare_q(q_nope, q_pe, self._q_dtype)
        q = torch.cat([q_nope, q_pe], dim=-1)
        if self.is_fp8:
            q = q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return q.to(self._q_dtype)

    def joined_q_dtype(self, batch: ForwardBatch) -> torch.dtype | None:
        """FlashMLA's q dtype (e4m3 for an fp8 cache, else bf16) for uniform batches FlashMLA
        attends, with fused ops on and `MLASERVE_JOINED_Q` not "0"; else None."""
        uniform = batch.mode.is_uniform  # and not a small batch (`ops/mla_decode.py`):
        if self._joined_q and uniform and isinstance(batch.attn_metadata, _Metadata):
            return self._q_dtype
        return None

    def forward_joined(self, layer_id: int, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, 576] contiguous in `joined_q_dtype(batch)`, the new KV already written ->
        [T, H, 512] bf16, H this rank's heads."""
        self.check_heads(q, "q")
        if not isinstance(batch.attn_metadata, _Metadata) or q.dtype != self._q_dtype:
            raise ValueError(
                f"flashmla: a joined query ({q.dtype}) needs a batch FlashMLA attends and "
                f"{self._q_dtype} (joined_q_dtype)"
            )
        return self._decode(layer_id, q, batch)

    def _decode(
        self,
        layer_id: int,
        q: torch.Tensor,
        batch: ForwardBatch,
        shape: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """FlashMLA on the prepared query q [T, H, 576] (contiguous, `self._q_dtype`) over
        layer `layer_id`'s cache, new KV included -> [T, H, 512] bf16. `shape`: (bs, q_len) of
        q's rows and the batch's first bs sequences (default: the uniform batch's)."""
        num_tokens, num_heads, width = q.shape
        bs, q_len = (batch.bs, batch.q_len) if shape is None else shape
        tables, seq_lens = batch.block_tables, batch.seq_lens
        if shape is not None:  # the batch's first bs sequences
            tables, seq_lens = tables[:bs], seq_lens[:bs]
        pool = batch.kv_pool
        extra = {}
        if self.is_fp8:
            extra = {"descale_q": self._q_descale, "descale_k": pool.k_scale_tensors[layer_id]}
        out, _ = self._flash_mla.flash_mla_with_kvcache(
            q.view(bs, q_len, num_heads, width),  # [bs, q_len, H, 576]
            pool.kv_buffers[layer_id].unsqueeze(2),  # [pages, 64, 1, 576]
            tables,
            seq_lens,
            head_dim_v=self.kv_lora_rank,
            tile_scheduler_metadata=batch.attn_metadata.sched,
            softmax_scale=self.softmax_scale,
            causal=True,
            is_fp8_kvcache=self.is_fp8,
            use_legacy=True,
            **extra,
        )  # [bs, q_len, H, 512] bf16
        return out.reshape(num_tokens, num_heads, self.kv_lora_rank)

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
        """Writes the new latent KV, up-projects every sequence's whole context (fp8 cache:
        dequantised first) to bf16 K/V, then one causal varlen FA2 launch. [T, H, d_v], H this
        rank's heads (q, w_uk, w_uv carry them)."""
        self.check_mha_heads(q, w_uk, w_uv)
        if isinstance(batch.attn_metadata, _AbsorbedHit):
            return self._absorbed_hit_attention(layer_id, q, kv_c, k_pe, w_uk, w_uv, batch)
        layout: ExtendLayout = batch.attn_metadata
        _, k, v = mha_context_kv(
            layer_id, kv_c, k_pe, w_uk, w_uv, batch, layout, self._mha_key, self._gather_dequant
        )
        if self._prefill_fresh.takes(layout, q.dtype):  # no cached prefix: cuDNN is faster
            out = self._prefill_fresh(q, k, v, layout, self.softmax_scale)
            if out is not None:
                return out
        return self._prefill(q, k, v, layout, self.softmax_scale)

    def _absorbed_hit_attention(
        self,
        layer_id: int,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """`forward_extend_mha`'s contract in the absorbed form (`absorbed_hit.py`): the new
        latent KV written, q [T, H, d_n + d_r] absorbed by W_UK to [T, H, r] (its rope part
        kept), FlashMLA over the latent cache with the T tokens causal, W_UV on the result ->
        [T, H, d_v] in q's dtype."""
        batch.kv_pool.write(layer_id, batch.slot_mapping, kv_c, k_pe)
        d_n = w_uk.shape[1]
        q_nope, q_pe = q[..., :d_n], q[..., d_n:]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
        hit: _AbsorbedHit = batch.attn_metadata
        q_joined = self._join_query(q_latent, q_pe)
        o_latent = self._decode(layer_id, q_joined, batch, shape=(1, hit.q_len)).to(q.dtype)
        out = o_latent.new_empty(q.shape[0], q.shape[1], w_uv.shape[2])
        torch.bmm(o_latent.transpose(0, 1), w_uv, out=out.transpose(0, 1))  # [H, T, d_v] view
        return out
