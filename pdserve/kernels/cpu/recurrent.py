"""Calls into csrc/recurrent_cpu.cpp: Gated DeltaNet's recurrent step and Mamba's selective
scan step in place on the requests' state slots, one pass over each state, each (request, head) with the same code whatever the
batch (batch invariance). Returns None where it does not apply; the caller runs its reference."""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels import backend
from pdserve.kernels.cpu import native

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def deltanet_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor | None:
    """One token of each of R requests: q, k [R, H, K], v [R, H, V], decay and beta [R, H],
    float32; `states` [num_slots, H, K, V] float32 (each slot contiguous, slots strided), the
    states at `slots` [R] updated in place. Returns the output [R, H, V]."""
    applies = (
        backend.use_cpu_kernels(q.device)
        and states.dtype == torch.float32
        and states[0].is_contiguous()
        and slots.dtype == torch.int64
    )
    fn = None
    if applies:
        fn = native.function(
            "recurrent_cpu", "pdserve_deltanet_step", _P, _P, _P, _P, _P, _P, _I64, _P, _P,
            _I64, _I64, _I64, _I64, _INT,
        )  # fmt: skip
    if fn is None:
        return None
    q, k, v, decay, beta, slots = (t.contiguous() for t in (q, k, v, decay, beta, slots))
    rows, heads, key_dim = q.shape
    out = torch.empty(rows, heads, v.shape[-1], dtype=torch.float32)
    fn(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        decay.data_ptr(),
        beta.data_ptr(),
        states.data_ptr(),
        states.stride(0),
        slots.data_ptr(),
        out.data_ptr(),
        rows,
        heads,
        key_dim,
        v.shape[-1],
        torch.get_num_threads(),
    )
    return out


def mamba_step(
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    u: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor | None:
    """One token of each of R requests: dt [R, channels] and A [channels, S] float32, B, C
    [R, S] and u [R, channels] in the activation dtype; `states` [num_slots, channels, S]
    float32 (each slot contiguous), the states at `slots` [R] updated in place. Returns the
    readout [R, channels], float32 sums of the dtype's products (round it to the dtype)."""
    applies = (
        backend.use_cpu_kernels(dt.device)
        and B.dtype in _DTYPES
        and B.dtype == C.dtype == u.dtype
        and states.dtype == torch.float32
        and states[0].is_contiguous()
        and slots.dtype == torch.int64
    )
    fn = None
    if applies:
        fn = native.function(
            "recurrent_cpu", "pdserve_mamba_step", _INT, _P, _P, _P, _P, _P, _P, _I64, _P, _P,
            _I64, _I64, _I64, _INT,
        )  # fmt: skip
    if fn is None:
        return None
    dt, A, B, C, u, slots = (t.contiguous() for t in (dt, A, B, C, u, slots))
    rows, channels = dt.shape
    out = torch.empty(rows, channels, dtype=torch.float32)
    fn(
        _DTYPES[B.dtype],
        dt.data_ptr(),
        A.data_ptr(),
        B.data_ptr(),
        C.data_ptr(),
        u.data_ptr(),
        states.data_ptr(),
        states.stride(0),
        slots.data_ptr(),
        out.data_ptr(),
        rows,
        channels,
        A.shape[1],
        torch.get_num_threads(),
    )
    return out
