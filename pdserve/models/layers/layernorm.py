"""Normalization layers."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from pdserve.kernels.norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm numerics: the variance in float32, the weight applied in the input dtype.

    Given the residual stream too, it adds it first (vLLM's fused_add_rms_norm) and returns
    (normalized, residual + x): one pass over the hidden states instead of two on a GPU.
    """

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.variance_epsilon = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon)
        return fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    def with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalized, the residual stream) where the stream may start here (the first layer's
        input is its own residual)."""
        if residual is None:
            return self(x), x
        return self(x, residual)


# OPT normalizes with torch's own LayerNorm (HF does too); named here so that models find every
# norm in one module.
LayerNorm = nn.LayerNorm
