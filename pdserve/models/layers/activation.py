"""Activation functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import elementwise_cpu


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] along the last dimension (gate_up_proj's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := elementwise_cpu.silu_and_mul(x)) is not None:
            return out
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU}


def get_act_fn(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"Activation function {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}."
        )
    return _ACTIVATIONS[name]()


def check_gated_act(name: str) -> None:
    """Gated MLPs (gate_up_proj) here compute silu; any other hidden_act would be silently wrong."""
    if name != "silu":
        raise ValueError(f"hidden_act={name!r} is not supported for gated MLPs; supported: 'silu'.")
