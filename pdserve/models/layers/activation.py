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


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up (Gemma's GeGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := elementwise_cpu.gelu_tanh_and_mul(x)) is not None:
            return out
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


# The activations of gated MLPs, by hidden_act (HF names tanh-approximated GELU two ways).
GATED_ACTIVATIONS: Registry[type[nn.Module]] = Registry(
    "gated MLP activation",
    "hidden_act",
    {
        "silu": "pdserve.models.layers.activation:SiluAndMul",
        "gelu_pytorch_tanh": "pdserve.models.layers.activation:GeluTanhAndMul",
        "gelu_tanh": "pdserve.models.layers.activation:GeluTanhAndMul",
    },
)

ACTIVATIONS: Registry[type[nn.Module]] = Registry(
    "activation function",
    "hidden_act",
    {"relu": "torch.nn:ReLU", "silu": "torch.nn:SiLU", "gelu": "torch.nn:GELU"},
)


def get_act_fn(name: str) -> nn.Module:
    return ACTIVATIONS.get(name)()


def check_gated_act(name: str) -> None:
    """The MoE experts (fused_moe.py) compute silu; any other hidden_act would be silently wrong."""
    if name != "silu":
        raise ValueError(
            f"hidden_act={name!r} is not supported for MoE experts; supported: 'silu'."
        )
