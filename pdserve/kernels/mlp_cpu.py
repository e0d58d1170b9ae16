"""The post-attention norm and a gated MLP in one call into csrc/linear_cpu.cpp, for decode-sized
bf16 batches on AMX. A decode step runs this pair once per layer, and in the engine each Python
call around a kernel costs more than the kernel (its interpreter state is evicted by the
weights streaming past): one call replaces four, with the same bits as the four (each step
runs the same C function as its own kernel)."""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels import backend, native
from pdserve.kernels.linear import AMX_BLOCK_K, AMX_MAX_ROWS, PackedWeight

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def norm_mlp(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: PackedWeight | None,
    gate_up_bias: torch.Tensor | None,
    down: PackedWeight | None,
    down_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(down(silu_and_mul(gate_up(rms_norm(residual + x)))), residual + x), or None where the
    fused kernel does not apply and the caller runs the steps one by one."""
    if gate_up is None or down is None or not (gate_up.amx and down.amx):
        return None
    hidden, intermediate = x.shape[-1], down.in_features
    rows = x.numel() // hidden
    if not 0 < rows <= AMX_MAX_ROWS or (hidden | intermediate) % AMX_BLOCK_K:
        return None
    if x.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16 or x.dim() != 2:
        return None
    if x.stride(-1) != 1 or residual.stride(-1) != 1 or not backend.use_cpu_kernels(x.device):
        return None
    fn = native.function(
        "linear_cpu", "pdserve_amx_norm_mlp", _P, _P, _I64, _I64, _P, _F, _I64, _I64, _P, _P,
        _I64, _P, _P, _P, _P, _INT,
    )  # fmt: skip
    residual_out = torch.empty((rows, hidden), dtype=torch.bfloat16)
    out = torch.empty((rows, hidden), dtype=torch.bfloat16)
    fn(
        x.data_ptr(),
        residual.data_ptr(),
        x.stride(0),
        residual.stride(0),
        norm_weight.data_ptr(),
        eps,
        rows,
        hidden,
        gate_up.data.data_ptr(),
        _ptr(gate_up_bias),
        intermediate,
        down.data.data_ptr(),
        _ptr(down_bias),
        residual_out.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out, residual_out
