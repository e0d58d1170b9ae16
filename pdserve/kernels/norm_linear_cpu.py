"""An RMSNorm and the matmuls after it in one call into csrc/linear_cpu.cpp, for decode-sized
bf16 batches on AMX: the input norm and q/k/v, and the post-attention norm and the gated MLP.
A decode step runs these once per layer, and in the engine each Python call around a kernel
costs more than the kernel (its interpreter state is evicted by the weights streaming past):
one call replaces two, or four. The bits are the steps' (each runs the same C function as its
own kernel). Each returns None where it does not apply, and the caller runs the steps."""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels import backend, native
from pdserve.kernels.linear import AMX_BLOCK_K, AMX_MAX_ROWS, PackedWeight

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _applies(x: torch.Tensor, residual: torch.Tensor | None, *weights: PackedWeight | None) -> bool:
    """bf16 rows of adjacent features, a decode-sized batch, AMX-packed weights whose K is whole
    32-k blocks."""
    if not all(w is not None and w.amx and w.in_features % AMX_BLOCK_K == 0 for w in weights):
        return False
    if x.dim() != 2 or not 0 < x.shape[0] <= AMX_MAX_ROWS or x.shape[1] % AMX_BLOCK_K:
        return False
    rows = (x,) if residual is None else (x, residual)
    return all(t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in rows) and (
        backend.use_cpu_kernels(x.device)
    )


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: PackedWeight | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(linear(rms_norm(residual + x)), residual + x); (linear(rms_norm(x)), x) without one."""
    if not _applies(x, residual, weight):
        return None
    assert weight is not None
    fn = native.function(
        "linear_cpu", "pdserve_amx_norm_linear", _P, _P, _I64, _I64, _P, _F, _I64, _I64, _P, _I64,
        _P, _P, _P, _INT,
    )  # fmt: skip
    rows, hidden = x.shape
    residual_out = torch.empty((rows, hidden), dtype=torch.bfloat16) if residual is not None else x
    out = torch.empty((rows, weight.out_features), dtype=torch.bfloat16)
    fn(
        x.data_ptr(),
        native.pointer(residual),
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        norm_weight.data_ptr(),
        eps,
        rows,
        hidden,
        weight.data.data_ptr(),
        weight.out_features,
        native.pointer(bias),
        residual_out.data_ptr() if residual is not None else None,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out, residual_out


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
    """(down(silu_and_mul(gate_up(rms_norm(residual + x)))), residual + x)."""
    if not _applies(x, residual, gate_up, down):
        return None
    assert gate_up is not None and down is not None
    fn = native.function(
        "linear_cpu", "pdserve_amx_norm_mlp", _P, _P, _I64, _I64, _P, _F, _I64, _I64, _P, _P,
        _I64, _P, _P, _P, _P, _INT,
    )  # fmt: skip
    rows, hidden = x.shape
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
        native.pointer(gate_up_bias),
        down.in_features,
        down.data.data_ptr(),
        native.pointer(down_bias),
        residual_out.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out, residual_out
