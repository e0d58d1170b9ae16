"""Calls into csrc/elementwise_cpu.cpp: RMSNorm, rotary embedding, SiLU- and GELU(tanh)-and-mul,
a sigmoid gate and Gated DeltaNet's gates on CPU in one pass each, in bfloat16 and float32. Each element's result depends only on its
row: torch's float32 kernels run a batch's last elements (and each thread's) through scalar
code whose exp differs from the vector one in the last bit, so their bits would depend on the
batch (batch invariance). Each returns None where it does not apply, and the caller runs its
reference."""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels import backend
from pdserve.kernels.cpu import native

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _applies(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return (
        dtype in _DTYPES
        and all(t.dtype == dtype for t in tensors)
        and backend.use_cpu_kernels(tensors[0].device)
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with adjacent elements (rows may be strided)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(rms_norm(residual + x), residual + x), or (rms_norm(x), None) without a residual."""
    if not _applies(x, weight) or (residual is not None and not _applies(residual)):
        return None
    fn = native.function(
        "elementwise_cpu", "pdserve_rms_norm", _INT, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64,
        _F, _INT,
    )  # fmt: skip
    if fn is None:
        return None
    x2 = _rows(x)
    residual2 = _rows(residual) if residual is not None else None
    out = torch.empty(x2.shape, dtype=x.dtype)
    residual_out = torch.empty_like(out) if residual is not None else None
    fn(
        _DTYPES[x.dtype],
        x2.data_ptr(),
        residual2.data_ptr() if residual2 is not None else None,
        weight.contiguous().data_ptr(),
        out.data_ptr(),
        residual_out.data_ptr() if residual_out is not None else None,
        x2.shape[0],
        x2.shape[1],
        x2.stride(0),
        residual2.stride(0) if residual2 is not None else 0,
        eps,
        torch.get_num_threads(),
    )
    return out.view(x.shape), residual_out.view(x.shape) if residual_out is not None else None


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """query [T, H, D] and key [T, KVH, D] rotated by the table rows of `positions`."""
    if not _applies(query, key, cos_sin_cache):
        return None
    fn = native.function(
        "elementwise_cpu", "pdserve_rotary", _INT, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64,
        _INT,
    )  # fmt: skip
    if fn is None:
        return None
    positions = positions.to(torch.int64).contiguous()
    table = cos_sin_cache.contiguous()
    outs = []
    for x in (query, key):
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        fn(
            _DTYPES[x.dtype],
            positions.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            table.data_ptr(),
            x.shape[0],
            x.shape[1],
            x.shape[2],
            x.stride(0),
            x.stride(1),
            torch.get_num_threads(),
        )
        outs.append(out)
    return outs[0], outs[1]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[..., :d]) * x[..., d:] for d = half the last dimension."""
    return _act_and_mul("pdserve_silu_and_mul", x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """gelu(x[..., :d], tanh approximation) * x[..., d:] for d = half the last dimension."""
    return _act_and_mul("pdserve_gelu_tanh_and_mul", x)


def _act_and_mul(symbol: str, x: torch.Tensor) -> torch.Tensor | None:
    if not _applies(x):
        return None
    fn = native.function("elementwise_cpu", symbol, _INT, _P, _P, _I64, _I64, _I64, _INT)
    if fn is None:
        return None
    x2 = _rows(x)
    d = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], d, dtype=x.dtype)
    fn(
        _DTYPES[x.dtype],
        x2.data_ptr(),
        out.data_ptr(),
        x2.shape[0],
        d,
        x2.stride(0),
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], d)


def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sigmoid(gate) * x for gate [T, 1] and x [T, d], each row's bits its own."""
    fn = None
    if _applies(gate, x) and gate.dim() == 2 and gate.shape[1] == 1:
        fn = native.function(
            "elementwise_cpu", "pdserve_sigmoid_mul", _INT, _P, _I64, _P, _P, _I64, _I64, _I64,
            _INT,
        )  # fmt: skip
    if fn is None:
        return torch.sigmoid(gate) * x
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype)
    fn(
        _DTYPES[x.dtype],
        gate.data_ptr(),
        gate.stride(0),
        x2.data_ptr(),
        out.data_ptr(),
        x2.shape[0],
        x2.shape[1],
        x2.stride(0),
        torch.get_num_threads(),
    )
    return out


def deltanet_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates of tokens a, b [N, heads]: (g, exp(g), beta), float32, with
    g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) (rounded to the dtype
    first, as HF's), each row's bits its own."""
    fn = None
    if _applies(a, b, a_log, dt_bias) and a.stride() == b.stride() and a.stride(-1) == 1:
        fn = native.function(
            "elementwise_cpu", "pdserve_deltanet_gates", _INT, _P, _P, _I64, _P, _P, _P, _P, _P,
            _I64, _I64, _INT,
        )  # fmt: skip
    if fn is None:
        g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
        return g, g.exp(), b.sigmoid().float()
    rows, heads = a.shape
    g, decay, beta = (torch.empty(rows, heads, dtype=torch.float32) for _ in range(3))
    fn(
        _DTYPES[a.dtype],
        a.data_ptr(),
        b.data_ptr(),
        a.stride(0),
        a_log.data_ptr(),
        dt_bias.data_ptr(),
        g.data_ptr(),
        decay.data_ptr(),
        beta.data_ptr(),
        rows,
        heads,
        torch.get_num_threads(),
    )
    return g, decay, beta
