"""RMSNorm exactly as DeepSeek / transformers compute it: normalize in fp32, cast back to the
input dtype, then scale by the weight (in the model dtype).

Built on CUDA (with Triton), the module runs the fused kernels of `mlaserve/ops/rms_norm.py`
(same roundings, one launch, and the residual add fused in `forward_with_residual`); the torch
code here is their reference and the CPU path. The choice is made once, from the weight's
device at construction (the loader builds modules on their final device).

The fused kernels run one program per row with a block fixed by N, so a row's bits never depend
on the batch: the deterministic mode (`deterministic=True`) keeps them. Its torch path instead
normalises one row at a time (torch's reductions may pick their split by the number of rows)."""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.ops import fused_ops_enabled
from mlaserve.ops.moe_partials import MoePartials, SortedExpertRows
from mlaserve.tensor_parallel import RankPartials, reduce_add_rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        params_dtype: torch.dtype = torch.float32,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.rowwise = deterministic  # the torch path one row at a time (unused when fused)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.fused = fused_ops_enabled(self.weight.device)
        if self.fused:
            from mlaserve.ops import rms_norm

            self._rms_norm, self._add_rms_norm = rms_norm.rms_norm, rms_norm.add_rms_norm
            self._add_partials_rms_norm = rms_norm.add_partials_rms_norm
            self._add_sorted_rms_norm = rms_norm.add_sorted_rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N] -> [..., N]"""
        if self.fused:
            return self._rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if self.rowwise and x.dim() == 2 and x.shape[0] > 1:
            return torch.cat([self._torch_norm(row) for row in x.split(1)])
        return self._torch_norm(x)

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward_with_residual(
        self,
        x: torch.Tensor | MoePartials | SortedExpertRows | RankPartials,
        residual: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, N] -> (norm(x + residual), x + residual); the sum rounded to x's
        dtype first, as the unfused `residual + x` is. x may be an MoE layer's uncombined
        output (`MoePartials`, `SortedExpertRows`): combined here, in the same launch on CUDA;
        or a tensor-parallel rank's partial sums (`RankPartials`, CUDA only): all-reduced here,
        in the same launch where the custom all-reduce takes the size."""
        if isinstance(x, RankPartials):
            fused = reduce_add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = MoePartials(x.all_reduced().unsqueeze(1), x.dtype)
        if isinstance(x, MoePartials):
            if self.fused:
                return self._add_partials_rms_norm(x.parts, residual, self.weight, self.eps)
            x = x.total()
        elif isinstance(x, SortedExpertRows):
            if self.fused:
                rows, _, pos, weights, shared = x
                return self._add_sorted_rms_norm(
                    rows, pos, weights, shared, residual, self.weight, self.eps
                )
            x = x.total()
        if self.fused:
            return self._add_rms_norm(x, residual, self.weight, self.eps)
        s = residual + x
        return self(s), s

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
