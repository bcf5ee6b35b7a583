"""Causal attention of fresh prompts (no cached prefix) through cuDNN's fused SDPA kernel, one
call per sequence: faster than torch's varlen FA2 (`flash_varlen.py`) for the MHA form of MLA
prefill, and it takes v's 128-wide head without padding (bench/prefill_attention.py; measured:
bench/RESULTS.md, "Prefill attention kernels, one layer, V2-Lite heads (16)").

Kernel boundary (`F.scaled_dot_product_attention` under `sdpa_kernel([CUDNN_ATTENTION])`):

    per sequence b: q [1, H, L_b, D], k [1, H, L_b, D], v [1, H, L_b, D_v]   bf16/fp16, views
                    of the ragged [T, H, D] rows (last dim contiguous, no copies)
    is_causal=True is cuDNN's top-left mask: correct only when q_len == kv_len, which is why the
    caller sends only `ExtendLayout.all_fresh` batches here (chunks over a prefix go to FA2).
    out [T, H, D_v] in q's dtype.

One launch per sequence, so it is meant for batches of few long prompts (`MAX_SEQS`). cuDNN
refuses a key length of 1 ("cudnn SDPA does not support key/value sequence length 1", torch
2.11), so a batch holding a 1-token prompt goes to FA2 (`takes`); any other
shape cuDNN's dispatcher refuses raises on the host before a launch, and `__call__` returns None
for the caller to use FA2 instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from mlaserve.kernels_adapter.mha_extend import ExtendLayout

__all__ = ["CudnnFreshAttention"]

_DTYPES = (torch.float16, torch.bfloat16)


class CudnnFreshAttention:
    #: more sequences than this go to the one-launch varlen kernel instead
    MAX_SEQS = 16

    def __init__(self, device: torch.device) -> None:
        """Probes cuDNN SDPA on `device` with DeepSeek's head dims (192 / 128) once, here."""
        self.device = device
        self.available = self._probe()
        self.refused = 0  # batches cuDNN's dispatcher refused (then run by FA2)

    def _probe(self) -> bool:
        if self.device.type != "cuda" or not torch.backends.cudnn.is_available():
            return False
        # The layouts the model passes: v a strided view of one GEMM's output (`mha_extend.
        # up_project`), q a view into wider projection rows (`MLAAttention`: q_pe roped in place).
        kv = torch.randn(16, 2, 256, dtype=torch.bfloat16, device=self.device)
        rows = torch.randn(16, 2 * 192 + 64, dtype=torch.bfloat16, device=self.device)
        q = rows[:, : 2 * 192].view(16, 2, 192)
        v = kv[..., 128:]
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None],
                    q.transpose(0, 1)[None],
                    v.transpose(0, 1)[None],
                    is_causal=True,
                )
        except RuntimeError:
            return False
        return out.shape == (1, 2, 16, 128) and bool(torch.isfinite(out).all())

    def takes(self, layout: ExtendLayout, dtype: torch.dtype) -> bool:
        return (
            self.available
            and layout.all_fresh
            and layout.bs <= self.MAX_SEQS
            and min(layout.q_lens, default=0) >= 2  # cuDNN refuses a key length of 1
            and dtype in _DTYPES
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: ExtendLayout,
        softmax_scale: float,
    ) -> torch.Tensor | None:
        """[T, H, D_v], or None if cuDNN's dispatcher refused a shape (nothing was launched
        for the refused sequence; the caller recomputes the whole batch with FA2). torch's
        cuDNN SDPA lays its output out as the query is (sequence-major here), so a batch of one
        sequence takes it as it is; several are copied into one [T, H, D_v] tensor."""
        out = None
        start = 0
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for n in layout.q_lens:
                rows = slice(start, start + n)
                try:
                    o = F.scaled_dot_product_attention(
                        q[rows].transpose(0, 1)[None],
                        k[rows].transpose(0, 1)[None],
                        v[rows].transpose(0, 1)[None],
                        is_causal=True,
                        scale=softmax_scale,
                    )  # [1, H, n, D_v]
                except RuntimeError:  # "No available kernel": refused at dispatch, on the host
                    self.refused += 1
                    return None
                o = o[0].transpose(0, 1)  # [n, H, D_v]
                if n == q.shape[0] and o.is_contiguous():
                    return o  # one sequence, laid out as q's rows: no copy
                if out is None:
                    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
                out[rows] = o
                start += n
        return out
