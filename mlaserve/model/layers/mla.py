"""Multi-head latent attention (DeepSeek-V2 section 2.1), always in the weight-absorbed form.

Per token, with H heads, r = kv_lora_rank, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim,
d_v = v_head_dim:

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))  or  q_proj(x)        [H, d_n + d_r]
    c_kv|k_pe = kv_a_proj_with_mqa(x);  c_kv = kv_a_layernorm(c_kv)        [r], [d_r]
    (q_a_proj or q_proj, and kv_a_proj_with_mqa, run as one GEMM: `fused_qkv_a_proj_with_mqa`)
    kv_b_proj = [W_UK; W_UV] per head: k_nope_h = W_UK_h c_kv, v_h = W_UV_h c_kv

Absorbing W_UK into the query (q_nope_h . W_UK_h c = (W_UK_h^T q_nope_h) . c) means keys and
values never leave the latent space: the cache stores only c_kv | k_pe (r + d_r values per
token, 576 for DeepSeek) and the attention kernel sees one shared "head" of width r + d_r. The
latent output o_h = sum_s p_hs c_s goes through W_UV_h, then o_proj.

Tensor parallelism (as vLLM and SGLang split DeepSeek): the H heads are split over the ranks,
each holding H/tp of them. q_b_proj (or q_proj) is column-parallel by heads, kv_b_proj too (so
W_UK / W_UV hold this rank's heads), o_proj row-parallel plus an all-reduce; q_a_proj and
kv_a_proj_with_mqa are replicated. The attention backend sees H/tp heads. The latent KV cache
is therefore the same on every rank: each rank computes and stores the full c_kv | k_pe of every
token (the latent is shared by all heads, so it cannot be split by heads), which costs tp times
the cache bytes of one copy across the node: a rank's KV capacity in tokens is that of one GPU
holding the whole cache, not tp times it (the weights, not the cache, shrink with tp).

Built with `deterministic=True` (`EngineConfig.deterministic_inference`, with the `invariant`
attention backend), every phase runs `_forward_invariant`: the linears and the per-head W_UK /
W_UV products by `ops.invariant_matmul`, the latent RMSNorm per row, RoPE elementwise in torch,
and the backend writes the new KV before attending (`kernels_adapter/invariant.py`): no MHA
prefill, no fused decode prologue, nothing chosen by the token count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from mlaserve import switches
from mlaserve.config import ModelConfig, QuantizationConfig
from mlaserve.model.layers.linear import (
    NO_TP,
    ColumnParallelLinear,
    MergedReplicatedLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TensorParallel,
)
from mlaserve.model.layers.norm import RMSNorm
from mlaserve.model.layers.rotary import apply_rope
from mlaserve.ops import fused_ops_enabled
from mlaserve.tensor_parallel import RankPartials

if TYPE_CHECKING:
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["MLAAttention"]

# transformers/DeepSeek build q_a_layernorm and kv_a_layernorm with the RMSNorm default eps,
# not config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        quant: QuantizationConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.deterministic = deterministic
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")  # local
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.rope_interleaved = config.model_type == "deepseek_v2" or config.rope_interleave
        h, hidden = config.num_attention_heads, config.hidden_size
        bias = config.attention_bias
        kw = {
            "params_dtype": params_dtype,
            "tp": tp,
            "quant": quant,
            "deterministic": deterministic,
        }
        norm_kw = {"params_dtype": params_dtype, "deterministic": deterministic}

        # q_a_proj (or q_proj) and kv_a_proj_with_mqa both read x: stored as one weight, one
        # GEMM (one launch per layer fewer at decode). Not where their TP layouts differ
        # (q_proj is column-parallel, kv_a replicated) or with biases (none in DeepSeek).
        q_out = self.q_lora_rank or h * config.qk_head_dim
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        self.q_out = q_out
        self.fused_qkv_a_proj_with_mqa: MergedReplicatedLinear | None = None
        if not bias and (self.q_lora_rank is not None or tp.size == 1):
            self.fused_qkv_a_proj_with_mqa = MergedReplicatedLinear(hidden, [q_out, latent], **kw)
        else:
            if self.q_lora_rank is None:
                self.q_proj = ColumnParallelLinear(hidden, q_out, bias=bias, **kw)
            else:
                self.q_a_proj = ReplicatedLinear(hidden, q_out, bias=bias, **kw)
            self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, latent, bias=bias, **kw)
        if self.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, **norm_kw)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, h * config.qk_head_dim, **kw)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, **norm_kw)
        # kv_b_proj is never run as a linear: it is only split into W_UK / W_UV for the
        # absorbed per-head bmm's. An FP8 checkpoint's kv_b_proj is therefore dequantised once at
        # load into params_dtype (as SGLang does off DeepGEMM): 2 x 16.8M params per V3 layer
        # (~2 GB bf16 for 61 layers), and the bmm's stay plain bf16 GEMMs.
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank,
            h * (self.qk_nope_head_dim + self.v_head_dim),
            params_dtype=params_dtype,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(h * self.v_head_dim, hidden, bias=bias, **kw)
        self.w_uk: torch.Tensor | None = None
        self.w_uv: torch.Tensor | None = None
        # On CUDA the latent RMSNorm, both RoPEs and (for backends that accept it) the paged KV
        # write run as one Triton kernel (`mlaserve/ops/mla_norm_rope.py`); the torch code in
        # `forward` is its reference.
        self._norm_rope = None
        # ... and at decode sizes, where attention takes q_latent and q_pe apart, with the W_UK
        # GEMV below in the same launch (`mlaserve/ops/mla_decode_prologue.py`).
        self._prologue = None
        # At decode sizes (<= `head_gemv_max_m(heads)` tokens) the absorbed W_UK / W_UV products
        # run as one Triton GEMV each (`mlaserve/ops/head_gemv.py`) instead of cuBLAS's bmm.
        self._head_gemv = None
        self._head_gemv_max_m = 0
        # the deterministic mode's per-head products (`_forward_invariant`)
        self._head_matmul = None
        if deterministic:
            from mlaserve.ops.invariant_rowwise import rowwise_head_matmul

            self._head_matmul = rowwise_head_matmul
            if fused_ops_enabled(self.kv_a_layernorm.weight.device):
                from mlaserve.ops.invariant_matmul import invariant_head_matmul

                self._head_matmul = invariant_head_matmul
        elif fused_ops_enabled(self.kv_a_layernorm.weight.device):
            from mlaserve.ops.head_gemv import HEAD_GEMV_MAX_M, head_gemv, head_gemv_max_m
            from mlaserve.ops.mla_decode_prologue import mla_decode_prologue
            from mlaserve.ops.mla_norm_rope import mla_norm_rope

            self._norm_rope = mla_norm_rope
            # `MLASERVE_DECODE_PROLOGUE=0`: the two kernels apart, for A/B runs
            if switches.decode_prologue():
                self._prologue = mla_decode_prologue
            self._head_gemv = head_gemv
            # the switch within what the kernel takes: past it a batch would fail mid-step
            limit = switches.head_gemv_max_m(head_gemv_max_m(self.num_heads))
            self._head_gemv_max_m = min(limit, HEAD_GEMV_MAX_M)
        # q's row stride in the projection output q_nope is a view of (head_gemv's warm-up)
        self._q_row_stride = (
            q_out + latent
            if self.q_lora_rank is None and self.fused_qkv_a_proj_with_mqa is not None
            else self.num_heads * config.qk_head_dim
        )
        # and the latent's [kv_c | k_pe] rows (the prologue's warm-up)
        self._latent_row_stride = q_out + latent if self.fused_qkv_a_proj_with_mqa else latent

    def process_weights_after_loading(self) -> None:
        """Split kv_b_proj into the absorbed projections. Views, no copies: each head's matrix
        is contiguous, only the batch stride differs, which batched GEMMs take as is."""
        w = self.kv_b_proj.weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )  # [H, d_n + d_v, r]
        self.w_uk = w[:, : self.qk_nope_head_dim, :]  # [H, d_n, r]: q_nope -> latent
        self.w_uv = w[:, self.qk_nope_head_dim :, :].transpose(1, 2)  # [H, r, d_v]: latent -> v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor | RankPartials:
        """x [T, hidden]; cos/sin [T, d_r / 2] -> [T, hidden]. `rows` [n] int64: only these rows'
        outputs are read, so o_proj runs on them alone -> [n, hidden] (attention, and its KV
        write, still covers all T rows). Under tensor parallelism on CUDA: this rank's partial
        sums (`RankPartials`), which the next norm all-reduces."""
        if self.w_uk is None:
            raise RuntimeError("MLAAttention: call process_weights_after_loading() after loading")
        if self._head_matmul is not None:
            return self._forward_invariant(x, cos, sin, batch, rows)
        num_tokens = x.shape[0]
        q, kv_c, k_pe = self.project(x)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        backend = batch.attn_backend
        mha = backend.mha_extend and not batch.mode.is_uniform
        # Decode modes of a backend that takes the KV written: the fused kernel stores each
        # token's cache row itself, and kv_c / k_pe come back None.
        written = self._norm_rope is not None and backend.accepts_written_kv and not mha
        head_gemv = self._head_gemv if 0 < num_tokens <= self._head_gemv_max_m else None
        q_dtype = None  # the joined query's, where the backend takes one
        if head_gemv is not None and written:
            q_dtype = backend.joined_q_dtype(batch)
        joined = q_dtype in (q_nope.dtype, torch.float8_e4m3fn)  # what the GEMV can write
        width = self.kv_lora_rank + self.qk_rope_head_dim  # of a joined query
        norm, q_latent = self.kv_a_layernorm, None
        if written:
            pool = batch.kv_pool
            cache = (
                pool.kv_buffers[self.layer_id],
                batch.slot_mapping,
                pool.k_scales[self.layer_id],
            )
            args = (norm.weight, norm.eps, cos, sin, self.rope_interleaved)
            if head_gemv is not None and self._prologue is not None:  # + W_UK, one launch
                if joined:  # [q_nope @ W_UK | rope(q_pe)] in the kernel's dtype
                    q_latent = q_nope.new_empty(num_tokens, self.num_heads, width, dtype=q_dtype)
                q_latent, q_pe = self._prologue(
                    kv_c, k_pe, q_nope, q_pe, *args, self.w_uk, *cache, joined=q_latent
                )
                kv_c = k_pe = None
            else:
                kv_c, k_pe, q_pe = self._norm_rope(kv_c, k_pe, q_pe, *args, *cache)
        elif self._norm_rope is not None:
            # MHA prefill: q_pe roped inside q's own rows, so q is the MHA query, uncopied
            out = {"q_pe_out": q_pe} if mha else {}
            kv_c, k_pe, q_pe = self._norm_rope(
                kv_c, k_pe, q_pe, norm.weight, norm.eps, cos, sin, self.rope_interleaved, **out
            )
        else:
            kv_c = norm(kv_c)
            q_pe = apply_rope(q_pe, cos, sin, self.rope_interleaved)  # [T, H, d_r]
            k_pe = apply_rope(k_pe, cos, sin, self.rope_interleaved)  # [T, d_r]

        if mha:
            if self._norm_rope is None:  # q_pe was roped into a new tensor
                q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, d_n + d_r]
            o = backend.forward_extend_mha(
                self.layer_id, q, kv_c, k_pe, self.w_uk, self.w_uv, batch
            )  # [T, H, d_v]
            return self._o_proj(o.reshape(num_tokens, self.num_heads * self.v_head_dim), rows)

        # Absorb W_UK: [H, T, d_n] @ [H, d_n, r] -> [H, T, r]
        if joined:
            # The GEMV writes the kernel's whole query [q_nope @ W_UK | q_pe] in its dtype: no
            # separate q preparation kernel (one launch per layer fewer).
            if q_latent is None:  # else the prologue wrote it
                q_latent = q_nope.new_empty(num_tokens, self.num_heads, width, dtype=q_dtype)
                head_gemv(q_nope, self.w_uk, out=q_latent, tail=q_pe)
            o_latent = backend.forward_joined(self.layer_id, q_latent, batch).to(q_nope.dtype)
        else:
            if q_latent is None and head_gemv is not None:  # else the prologue's, or bmm
                q_latent = head_gemv(q_nope, self.w_uk)  # [T, H, r]
            elif q_latent is None:
                q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            o_latent = backend.forward(self.layer_id, q_latent, q_pe, kv_c, k_pe, batch)
        # o_latent [T, H, r] in the model dtype
        # Up-project with W_UV: [H, T, r] @ [H, r, d_v] -> [H, T, d_v], written straight into
        # the [T, H, d_v] rows o_proj reads (bmm through a transposed view: cuBLAS takes the
        # strides; `.transpose(0, 1).reshape` would copy whenever T > 1).
        o = o_latent.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        if head_gemv is not None:
            head_gemv(o_latent, self.w_uv, out=o)
        else:
            torch.bmm(o_latent.transpose(0, 1), self.w_uv, out=o.transpose(0, 1))
        return self._o_proj(o.view(num_tokens, self.num_heads * self.v_head_dim), rows)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, d_nope + d_r], kv_c [T, r], k_pe [T, d_r] (kv_c and k_pe
        views of one latent row; before the kv_a norm and RoPE). Callers split q into q_nope
        and q_pe views: the MHA prefill ropes q_pe in place and then reads q whole."""
        if self.fused_qkv_a_proj_with_mqa is not None:
            q, latent = self.fused_qkv_a_proj_with_mqa(x).split(
                [self.q_out, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
            )  # views of one [T, q_out + r + d_r] output
        else:
            q = self.q_proj(x) if self.q_lora_rank is None else self.q_a_proj(x)
            latent = self.kv_a_proj_with_mqa(x)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(x.shape[0], self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return q, kv_c, k_pe

    def _forward_invariant(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        rows: torch.Tensor | None,
    ) -> torch.Tensor | RankPartials:
        """`forward` in the deterministic mode (module docstring): the absorbed form in every
        phase, each step a function of the token's own row (and, in attention, of the cache
        bytes of its keys 0..p, its own written first)."""
        num_tokens, head_matmul = x.shape[0], self._head_matmul
        q, kv_c, k_pe = self.project(x)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)  # [T, r]
        q_pe = apply_rope(q_pe, cos, sin, self.rope_interleaved)  # [T, H, d_r]
        k_pe = apply_rope(k_pe, cos, sin, self.rope_interleaved)  # [T, d_r]
        q_latent = head_matmul(q_nope, self.w_uk.transpose(1, 2))  # [T, H, r]
        o_latent = batch.attn_backend.forward(self.layer_id, q_latent, q_pe, kv_c, k_pe, batch)
        o = head_matmul(o_latent, self.w_uv.transpose(1, 2))  # [T, H, d_v]
        return self._o_proj(o.reshape(num_tokens, self.num_heads * self.v_head_dim), rows)

    def _o_proj(self, o: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | RankPartials:
        """o [T, H * d_v] -> [T, hidden], or [n, hidden] of `rows` alone; under tensor
        parallelism on CUDA this rank's partial sums, for the next norm to all-reduce
        (`RowParallelLinear.forward_partials`)."""
        return self.o_proj.forward_partials(o if rows is None else o.index_select(0, rows))

    def warm_up_tasks(self, act_dtype: torch.dtype) -> list[Callable[[], None]]:
        """The decode kernels' compiles for every token bucket they take, a task per variant
        (`model/kernel_warm_up.py`), for before serving (and the fused norm + RoPE's of wider
        steps and prefills): W_UK's (in the prologue, `mla_decode_prologue`, or alone) with
        q_nope as a view of the q projection's rows, also as the joined query, in each dtype a
        backend may want it in (the cache's is unknown here, so bf16 activations compile both
        bf16 and, where e4m3 casts compile (SM89+), fp8; others their own dtype only); W_UV's on
        a contiguous latent."""
        if self._head_gemv is None or self.w_uk is None:  # x takes the weights' dtype
            return []
        from mlaserve.ops.head_gemv import head_gemv_warm_up_tasks
        from mlaserve.ops.mla_decode_prologue import mla_decode_prologue_warm_up_tasks
        from mlaserve.ops.mla_norm_rope import mla_norm_rope_warm_up_tasks

        dtype, dev = self.w_uk.dtype, self.w_uk.device
        h, d_r, r = self.num_heads, self.qk_rope_head_dim, self.kv_lora_rank
        fp8 = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9)
        out_dtypes = (dtype, torch.float8_e4m3fn) if dtype == torch.bfloat16 and fp8 else (dtype,)
        q_strides = (self._q_row_stride, self.qk_nope_head_dim + d_r)
        dims = (self.qk_nope_head_dim, d_r, r)
        # The prefill's and the wide uniform steps' norm + RoPE (their token count does not
        # select a variant: 16 rows stand for all)
        tasks = mla_norm_rope_warm_up_tasks(
            q_strides, self._latent_row_stride, dims, h, self.kv_a_layernorm.weight,
            self.rope_interleaved, dtype, out_dtypes, 16,
        )  # fmt: skip
        if self._prologue is not None:
            tasks += mla_decode_prologue_warm_up_tasks(
                q_strides, self._latent_row_stride, dims,
                self.kv_a_layernorm.weight, self.w_uk, self.rope_interleaved, out_dtypes,
                self._head_gemv_max_m,
            )  # fmt: skip
        # alone: for backends that take no written KV (and the joined query without prologue)
        tail = None if self._prologue is not None else (d_r, (h * d_r, d_r))
        tasks += head_gemv_warm_up_tasks(
            q_strides, h, self.w_uk, self._head_gemv_max_m, tail=tail, out_dtypes=out_dtypes
        )
        return tasks + head_gemv_warm_up_tasks((h * r, r), h, self.w_uv, self._head_gemv_max_m)
