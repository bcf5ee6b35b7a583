"""TokenSpeed MLA on Blackwell (SM100/103/107), from the `tokenspeed-mla` package (CuTe DSL).

NEVER RUN ON A B200: every call below is checked on a CPU against the installed package's real
signatures and stated constraints (`tests/kernels_adapter/test_blackwell_contract.py`).

Decode / verify kernel boundary (`tokenspeed_mla.tokenspeed_mla_decode`, 2.0.4), with H the
heads of this tensor-parallel rank (`num_heads`: DeepSeek-V3 128 / 64 / 32 / 16 at TP 1/2/4/8):

    query        [bs, q_len, H, 576] float8_e4m3fn (the kernel asserts kv_cache.dtype == query
                 dtype, so an fp8 cache takes an fp8 query: cast unscaled, |q| << 448)
    kv_cache     the pool's [num_pages, page_size, 576] e4m3 tensor of the layer, as is
    block_tables [bs, max_pages] int32, compact row-major: full-width rows of the runner's
                 buffer (the CuTe DSL binds it as a compact tensor; a column slice would be wrong)
    seq_lens     [bs] int32, KV length including this step's q_len tokens; query row i sees
                 keys 0 .. seq_len - q_len + i
    max_seq_len  host int = max_model_len, the capture bound: it picks split-KV and the
                 workspace slice, so a fixed value keeps graphs stable and never reads the device
    scales       no q/k scale arguments: value = stored * k_scale, so
                 softmax_scale = k_scale * model softmax_scale, output_scale = k_scale (the
                 latent is also V), both Python floats
    workspace    1-D int8 (the kernel asserts int8), >= its own size for the call; holds only
                 split-KV partials (no zero-init needed). Allocated once here for H and
                 max_q_len (`workspace_bytes`)
    returns      [bs, q_len, H, 512] bf16

Heads and q_len (per rank). The package's hard limit is H <= 128 (`can_implement`: the heads of
one query token must fit one 128-row MMA tile); its README documents 1 <= q_len <= 4 at any such
H. Beyond 4 the adapter takes a q_len only where H * q_len <= 128: the package then folds all
q_len tokens into the tile's rows (`get_mla_decode_fold_sq_factor` = q_len), so the kernel runs
its q_len-1 shape with H * q_len rows (checked against the package in the contract tests). So
DeepSeek-V3 at TP8 (16 heads) verifies k = 3..7 draft tokens (q_len 4..8), at TP1 (128 heads)
k <= 3, not more (`max_q_len_for`).

Prefill (EXTEND) runs in the MHA form (`mha_extend.py`) through `tokenspeed_mla_prefill`:
ragged fp8 Q [T, H, 192], K [S, H, 192], V [S, H, 128] (contiguous: the TMA ignores strides),
cum_seq_lens (KV) / cum_seq_lens_q int32 [bs+1], bottom-right aligned causal mask
(`MaskEnum.WINDOW_MASK_INFERENCE`), bf16 out [T, H, 128]. Each prefill variant compiles for 1.5-2
minutes, so `warmup_compile_prefill` runs at construction on the GPU, and every call uses the
variant it compiles (causal, return_lse=True; the LSE is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
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

__all__ = ["TokenspeedBackend", "workspace_bytes"]

CAPABILITIES = ((10, 0), (10, 3), (10, 7))  # get_mla_decode_arch accepts exactly these
PAGE_SIZES = (32, 64)  # the kernel takes 2..128; TokenSpeed's runtime uses 32/64 only
MAX_HEADS = 128  # one 128-row MMA tile of heads (per rank)
DOCUMENTED_Q_LEN = 4  # the package README's 1 <= q_len <= 4, at any H <= 128
PREFILL_DIMS = (192, 128)  # (d_n + d_r, d_v) the prefill is pre-compiled for (DeepSeek)


def workspace_bytes(num_sms: int, num_heads: int, max_q_len: int, kv_lora_rank: int = 512) -> int:
    """Closed-form bound of `tokenspeed_mla_decode`'s split-KV workspace, for any batch size and
    any q_len <= max_q_len (TokenSpeed sizes its own buffer the same way); `num_heads` per rank.

    The kernel needs B * H_eff * q_eff * split_kv * (kv_lora_rank + 1) * 4 bytes (fp32 partial
    rows plus one LSE), 0 when split_kv == 1, with H_eff * q_eff = H * q_len folded, or
    128 * ceil(H * q_len / 128) packed (only when H * q_len > 128). Its split heuristic keeps
    B * q_eff * split_kv * m <= num_sms (m = 2 CTAs per M128 tile, 1 for the fp8 M64 kernel),
    so B * H_eff * q_eff * split_kv <= num_sms * H * q_len in every case: the bound does not
    grow with the batch, because split-KV shrinks as the batch grows.
    """
    return num_sms * num_heads * max_q_len * (kv_lora_rank + 1) * 4


def _import_tokenspeed():
    try:
        import tokenspeed_mla
        from tokenspeed_mla import mla_decode  # the real module: the package stubs on failure
    except ImportError as e:
        raise BackendUnsupportedError(
            "attention_backend 'tokenspeed' needs the tokenspeed-mla package "
            f"(pip install 'mlaserve[blackwell]'): {e}"
        ) from None
    del mla_decode
    return tokenspeed_mla


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).contiguous()


@dataclass
class _DecodeMetadata:
    block_tables: torch.Tensor  # [bs, max_pages] int32, compact


class TokenspeedBackend(BlackwellBackend):
    name: ClassVar[str] = "tokenspeed"
    # q_len <= 4 at any head count; 5..8 only where heads x q_len fits one 128-row tile
    # (`max_q_len_for`; module docstring).
    max_uniform_q_len: ClassVar[int] = 8
    q_len_rule: ClassVar[str] = (
        f"tokenspeed_mla documents q_len <= {DOCUMENTED_Q_LEN}; longer only where heads x q_len "
        f"<= {MAX_HEADS}, folded into one 128-row MMA tile"
    )

    @classmethod
    def max_q_len_for(cls, num_heads: int) -> int:
        """q_len <= 4 at any head count (documented), or up to 8 where num_heads * q_len <= 128
        (all tokens folded into one MMA tile): 4 for 32..128 heads a rank, 8 for 16."""
        return min(cls.max_uniform_q_len, max(DOCUMENTED_Q_LEN, MAX_HEADS // num_heads))

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
            problem = f"its kernels are SM100/SM103/SM107 (Blackwell) only, got {target.sm_name}"
        elif kv_cache_dtype != torch.float8_e4m3fn:
            problem = (
                f"kv_cache_dtype must be fp8_e4m3 (its MLA prefill is fp8-only), got "
                f"{kv_cache_dtype}"
            )
        elif page_size not in PAGE_SIZES:
            problem = f"page_size must be 32 or 64, got {page_size}"
        elif dims := latent_dims_problem(mc):
            problem = dims
        elif heads > MAX_HEADS:
            problem = (
                f"heads per rank (num_attention_heads {mc.num_attention_heads} / tensor-parallel "
                f"size) must be <= {MAX_HEADS}, got {heads}"
            )
        elif (mc.qk_head_dim, mc.v_head_dim) != PREFILL_DIMS:
            problem = (
                "qk_nope_head_dim + qk_rope_head_dim / v_head_dim must be 192/128 for its "
                f"prefill kernel, got {mc.qk_head_dim}/{mc.v_head_dim}"
            )
        if problem:
            raise BackendUnsupportedError(f"attention_backend 'tokenspeed': {problem}")
        cls.check_shape(mc, heads, max_q_len)  # heads x q_len (`max_q_len_for`)
        _import_tokenspeed()

    def _init_kernels(self) -> None:
        self._ts = _import_tokenspeed()
        # Once, for this rank's heads and the largest q_len in use, never grown while serving
        # (a lazily grown buffer would allocate on the first long verify batch and break
        # captured graphs).
        self.workspace = torch.empty(
            workspace_bytes(self.target.num_sms, self.num_heads, self.max_q_len, self.kv_lora_rank),
            dtype=torch.int8,
            device=self.device,
        )
        if self.on_gpu:
            # 1.5-2 minutes per variant: pay it at start-up, not on the first long prompt.
            self._ts.warmup_compile_prefill(
                q_dtype=torch.float8_e4m3fn,
                d_qk=self.model_config.qk_head_dim,
                d_v=self.model_config.v_head_dim,
            )

    # -- metadata ---------------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch) -> None:
        if not batch.mode.is_uniform:
            batch.attn_metadata = extend_layout(batch)  # host lengths; shared by all layers
            return
        self.check_uniform_bounds(batch)
        tables = batch.block_tables
        # Full-width rows of the runner's buffer are compact already; anything else is copied
        # (a device op, capturable) rather than handed to a kernel that ignores its strides.
        batch.attn_metadata = _DecodeMetadata(
            block_tables=tables if tables.is_contiguous() else tables.contiguous()
        )

    # -- decode / verify --------------------------------------------------------------------

    def decode_kwargs(
        self, layer_id: int, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch
    ) -> dict[str, Any]:
        """The exact keyword arguments of `tokenspeed_mla_decode` (shapes in the module doc):
        q_nope [T, H, 512], q_pe [T, H, 64] with H this rank's heads, T = bs * q_len."""
        self.check_heads(q_nope, "q_nope")
        self.check_heads(q_pe, "q_pe")
        meta: _DecodeMetadata = batch.attn_metadata
        pool = batch.kv_pool
        k_scale = float(pool.k_scales[layer_id])
        q = torch.cat([q_nope, q_pe], dim=-1).view(batch.bs, batch.q_len, self.num_heads, -1)
        return {
            "query": _e4m3(q),
            "kv_cache": pool.kv_buffers[layer_id],
            "workspace_buffer": self.workspace,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "block_tables": meta.block_tables,
            "seq_lens": batch.seq_lens,
            "max_seq_len": self.max_model_len,
            "softmax_scale": k_scale * self.softmax_scale,
            "output_scale": k_scale,
            "is_var_seq": True,
            "causal_mask": True,
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
                "tokenspeed: EXTEND batches take the MHA form (forward_extend_mha)"
            )
        batch.kv_pool.write(layer_id, batch.slot_mapping, kv_c, k_pe)
        out = self._ts.tokenspeed_mla_decode(**self.decode_kwargs(layer_id, q_nope, q_pe, batch))
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
        `tokenspeed_mla_prefill` over every sequence's whole context. q [T, H, 192], w_uk
        [H, 128, 512], w_uv [H, 512, 128]: this rank's heads."""
        self.check_mha_heads(q, w_uk, w_uv)
        layout: ExtendLayout = batch.attn_metadata
        _, k, v = mha_context_kv(layer_id, kv_c, k_pe, w_uk, w_uv, batch, layout)
        return {
            "query": _e4m3(q),
            "key": _e4m3(k),
            "value": _e4m3(v),
            "seq_lens": layout.kv_lens_dev,
            "cum_seq_lens": layout.cu_kv,
            "max_seq_len": layout.max_kv_len,
            "batch_size": layout.bs,
            # K and V are up-projected from the dequantized latent and cast unscaled.
            "softmax_scale": self.softmax_scale,
            "is_causal": True,
            "return_lse": True,  # the variant warmup_compile_prefill compiled
            "cum_seq_lens_q": layout.cu_q,
            "max_seq_len_q": layout.max_q_len,
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
        kwargs = self.prefill_kwargs(layer_id, q, kv_c, k_pe, w_uk, w_uv, batch)
        out, _lse = self._ts.tokenspeed_mla_prefill(**kwargs)  # [T, H, d_v] bf16
        return out.to(q.dtype)
