"""FP8 (e4m3) constants and the column-major scale buffer, shared by the torch reference
(`fp8_quant.py`) and the Triton kernels (`fp8_triton.py`). A leaf so that `fp8_quant` may
import `fp8_triton` without `fp8_triton` importing it back.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "FP8_MAX", "column_major_scale_buffer"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0


def column_major_scale_buffer(
    m: int, kb: int, device: torch.device, align_rows: int = 1
) -> torch.Tensor:
    """An empty [m, kb] fp32 tensor stored column-major (stride (1, m_pad)), m_pad = m rounded up
    to `align_rows`: the layout of torch's blockwise and flashinfer's 1x128 activation scales
    (align 4 keeps every column 16-byte aligned)."""
    m_pad = -(-m // align_rows) * align_rows
    return torch.empty((kb, m_pad), dtype=torch.float32, device=device)[:, :m].t()
