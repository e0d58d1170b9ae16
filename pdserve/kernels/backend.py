"""Which implementation a kernel call runs: Triton or the torch reference."""

from __future__ import annotations

import importlib.util

import torch

from pdserve import envs

HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device) -> bool:
    """Triton for CUDA tensors, torch for the rest, unless PDSERVE_KERNEL_BACKEND forces one."""
    forced = envs.kernel_backend()
    if forced == "torch":
        return False
    if forced == "triton":
        if not HAS_TRITON:
            raise ValueError("PDSERVE_KERNEL_BACKEND=triton, but Triton is not installed.")
        return True
    return HAS_TRITON and device.type == "cuda"


def use_cpu_kernels(device: torch.device) -> bool:
    """The C++ kernels (kernels/cpu/native.py) for CPU tensors, unless PDSERVE_KERNEL_BACKEND=torch."""
    return device.type == "cpu" and envs.kernel_backend() != "torch"
