"""Activation functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.cpu import elementwise as elementwise_cpu
from pdserve.registry import Registry


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] along the last dimension (gate_up_proj's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := elementwise_cpu.silu_and_mul(x)) is not None:
            return out
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


ACTIVATIONS: Registry[type[nn.Module]] = Registry(
    "activation function",
    "hidden_act",
    {"relu": "torch.nn:ReLU", "silu": "torch.nn:SiLU", "gelu": "torch.nn:GELU"},
)


def get_act_fn(name: str) -> nn.Module:
    return ACTIVATIONS.get(name)()


def check_gated_act(name: str) -> None:
    """Gated MLPs (gate_up_proj) here compute silu; any other hidden_act would be silently wrong."""
    if name != "silu":
        raise ValueError(f"hidden_act={name!r} is not supported for gated MLPs; supported: 'silu'.")
