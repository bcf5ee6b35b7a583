"""Attention kernels behind one narrow interface (`base.AttentionBackend`) and a registry.

`reference` is pure torch, runs everywhere and is the oracle every other backend is tested
against. `flashmla` (SM90), `trtllm` and `tokenspeed` (SM100) adapt kernel packages; all three
take prefill in the MHA form, whose shared pure-torch part is `mha_extend.py` (on SM90 the
attention itself is torch's causal varlen FA2, `flash_varlen.py`).
"""

from mlaserve.kernels_adapter.base import (
    AttentionBackend,
    BackendUnsupportedError,
    per_rank_heads,
)
from mlaserve.kernels_adapter.registry import (
    available_backends,
    get_backend_class,
    make_backend,
    resolve_backend_name,
)

__all__ = [
    "AttentionBackend",
    "BackendUnsupportedError",
    "available_backends",
    "get_backend_class",
    "make_backend",
    "per_rank_heads",
    "resolve_backend_name",
]
