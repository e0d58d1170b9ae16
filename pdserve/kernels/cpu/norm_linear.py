"""An RMSNorm and the matmuls after it in one call into csrc/linear_cpu.cpp, for bf16 batches
(AMX or AVX512-BF16): the input norm and q/k/v, and the post-attention norm and the gated MLP.
A decode step runs these once per layer, and in the engine each Python call around a kernel
costs more than the kernel (its interpreter state is evicted by the weights streaming past):
one call replaces two, or four. The bits are the steps' (each runs the same C function as its
own kernel). Each returns None where it does not apply, and the caller runs the steps."""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import backend
from pdserve.kernels.cpu import native
from pdserve.kernels.linear import BLOCK_K, PackedWeight

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.cache
def _fused_available() -> bool:
    lib = native.load("linear_cpu")
    return lib is not None and lib.pdserve_fused_available() == 1


def _applies(x: torch.Tensor, residual: torch.Tensor | None, *weights: PackedWeight | None) -> bool:
    """bf16 rows of adjacent features, bf16-packed weights whose K is whole 32-k blocks, and a
    library built with the fused calls (AVX512-BF16)."""
    if not all(
        w is not None and w.data.dtype == torch.bfloat16 and w.in_features % BLOCK_K == 0
        for w in weights
    ):
        return False
    if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] % BLOCK_K:
        return False
    if not _fused_available():
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
        "linear_cpu", "pdserve_norm_linear", _P, _P, _I64, _I64, _P, _F, _I64, _I64, _P, _I64,
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
        "linear_cpu", "pdserve_norm_mlp", _P, _P, _I64, _I64, _P, _F, _I64, _I64, _P, _P,
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
