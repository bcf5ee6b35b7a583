"""Causal varlen (ragged) attention through torch's own FlashAttention-2 kernels, for the MHA form
of MLA prefill on GPUs whose vendor packages ship no dense prefill kernel (Hopper: FlashMLA's
dense kernels are decode only).

Kernel boundary (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10; aten's FA2 underneath):

    q    [T, H, D]   bf16/fp16, D = d_n + d_r (192 for DeepSeek), last dim contiguous
    k    [S, H, D]   same dtype
    v    [S, H, D_v] same dtype; FA2 wants D_v == D on the torch builds that reject otherwise:
                     then v is zero-padded to D and the output sliced back (the padded columns
                     of P @ V are zero, so the first D_v columns are exact)
    cu_q [bs + 1] int32, cu_k [bs + 1] int32: row offsets of each sequence in q and k/v
    out  [T, H, D_v] in q's dtype

Causal with more keys than queries is FA2's bottom-right alignment: query row i of a sequence
with q_len new tokens and L keys sees keys 0 .. L - q_len + i, the mask of `mha_extend.py`, so a
prefill chunk over a cached prefix is exact. torch 2.10 spells causal `is_causal=True`; 2.11
spells it `window_size=(-1, 0)` (and adds `scale`); the signature is read once, here.

Why this kernel (bench/prefill_attention.py; measured: bench/RESULTS.md, "Prefill attention
kernels, one layer, V2-Lite heads (16)"): torch 2.11's FA2 rejects v 128 with q 192 (so v is
padded); cuDNN's SDPA is faster but its causal mask is top-left, so it only takes fresh prompts
(`cudnn_fresh.py`); SDPA's flash backend has no kernel for these head dims. A hit of a few new tokens over a long
cached prefix splits the prefix over more CTAs (`prefix_split.py`).
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING

import torch

from mlaserve.kernels_adapter.prefix_split import plan_split, split_prefix_attention

if TYPE_CHECKING:
    from mlaserve.kernels_adapter.mha_extend import ExtendLayout

__all__ = ["FlashVarlenAttention", "flash_varlen_available"]

_DTYPES = (torch.float16, torch.bfloat16)


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _lse_request():
    """`AuxRequest(lse=True)` where this torch's varlen_attn returns the log-sum-exp, else None."""
    try:
        from torch.nn.attention.varlen import AuxRequest
    except ImportError:
        return None
    return AuxRequest(lse=True)


def flash_varlen_available(device: torch.device) -> bool:
    """torch has `varlen_attn` and `device` is a CUDA GPU its FA2 kernels run on (SM80+)."""
    return (
        device.type == "cuda"
        and _varlen_attn() is not None
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


class FlashVarlenAttention:
    """`__call__(q, k, v, layout, softmax_scale) -> [T, H, D_v]`: one FA2 launch per layer for
    the whole ragged batch. Construction probes, on `device`, whether this torch's FA2 takes a
    value head dim different from the query's (one tiny launch, at start-up, never per step)."""

    def __init__(self, device: torch.device) -> None:
        fn = _varlen_attn()
        if fn is None or not flash_varlen_available(device):
            raise RuntimeError("FlashVarlenAttention: needs torch >= 2.10 on an SM80+ CUDA GPU")
        self._fn = fn
        params = inspect.signature(fn).parameters
        self._causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        self._takes_scale = "scale" in params
        self.device = device
        self.pads_v = not self._accepts_narrow_v()
        self._lse = _lse_request() if "return_aux" in params else None
        self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def _accepts_narrow_v(self) -> bool:
        q = torch.randn(8, 2, 64, dtype=torch.bfloat16, device=self.device)
        v = torch.randn(8, 2, 32, dtype=torch.bfloat16, device=self.device)
        cu = torch.tensor([0, 8], dtype=torch.int32, device=self.device)
        try:
            out = self._fn(q, q, v, cu, cu, 8, 8, **self._causal)
        except RuntimeError:
            return False
        return out.shape[-1] == 32

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: ExtendLayout,
        softmax_scale: float,
    ) -> torch.Tensor:
        out_dtype, d_v = q.dtype, v.shape[-1]
        dtype = q.dtype if q.dtype in _DTYPES else torch.bfloat16
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if self.pads_v and d_v != q.shape[-1]:
            padded = v.new_zeros(*v.shape[:-1], q.shape[-1])
            padded[..., :d_v] = v
            v = padded
        extra = {}
        if self._takes_scale:
            extra["scale"] = softmax_scale
        else:  # the kernel's default scale is 1/sqrt(D): fold the rest into q
            q = q * (softmax_scale * math.sqrt(q.shape[-1]))
        q = q.contiguous() if q.stride(-1) != 1 else q
        plan = None
        if self._lse is not None:
            plan = plan_split(layout.q_lens, layout.kv_lens, q.shape[1], self._num_sms)
        if plan is not None:
            out = split_prefix_attention(self._fn, self._lse, q, k, v, plan, self._causal, extra)
            return out[..., :d_v].to(out_dtype)
        extra.update(self._causal)
        out = self._fn(
            q, k, v, layout.cu_q, layout.cu_kv, layout.max_q_len, layout.max_kv_len, **extra
        )
        return out[..., :d_v].to(out_dtype)
