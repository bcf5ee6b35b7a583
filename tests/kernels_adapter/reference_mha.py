"""The reference backend with EXTEND in the MHA form (`kernels_adapter/mha_extend.py`): the CPU
stand-in for a Blackwell or FlashMLA prefill path, in the model and graph-runner tests."""

from __future__ import annotations

from typing import ClassVar

import torch

from mlaserve.engine.forward_batch import ForwardBatch
from mlaserve.kernels_adapter.mha_extend import reference_extend_mha
from mlaserve.kernels_adapter.reference import ReferenceBackend


class ReferenceMHA(ReferenceBackend):
    """The reference backend with EXTEND in the MHA form: what a prefill kernel plugs into."""

    mha_extend: ClassVar[bool] = True

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
        return reference_extend_mha(layer_id, q, kv_c, k_pe, w_uk, w_uv, batch, self.softmax_scale)
