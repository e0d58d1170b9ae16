"""Normalization layers."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm numerics: the variance in float32, the weight applied in the input dtype."""

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)


# OPT normalizes with torch's own LayerNorm (HF does too); named here so that models find every
# norm in one module.
LayerNorm = nn.LayerNorm
