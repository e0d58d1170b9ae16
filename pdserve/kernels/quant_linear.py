"""Linear layers on CPU with GGUF-quantized weights kept in their blocks (Q4_0, Q4_1, Q8_0, Q4_K),
for csrc/quant_linear.h: packed once after loading, about 4.5-8.5 bits a weight read
per step instead of bf16's 16.

bf16 activations take llama.cpp's numerics: each row quantized per 32-k block to int8, integer
block sums (VNNI), float32 across blocks. float32 activations take the exact path: each weight
dequantized as gguf dequantizes it, one FMA per k in order, the bits of the float32 packed
kernel over the dequantized weights (kernels/linear.py). Both are batch invariant (a row's
sums depend on the row alone). docs/quantization.md states the bound of the bf16 path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels import backend
from pdserve.kernels.cpu import native

# ggml's type ids of the formats the kernel reads.
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12}
# Those that kernels/triton/quant_matmul.py reads (its 32-k steps do not take Q4_K's super-blocks).
TRITON_QTYPES = (QTYPES["Q4_0"], QTYPES["Q4_1"], QTYPES["Q8_0"])
BLOCK = 32  # weights per block, along K
# A row's bytes per 32 weights; Q4_K's rows are whole super-blocks of 256 (144 bytes).
_BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 12: 18}
_ROW_MULTIPLE = {12: 256}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass(frozen=True)
class QuantWeight:
    data: torch.Tensor  # uint8: quant_linear_cpu.cpp's panels
    qtype: int
    out_features: int
    in_features: int


@dataclass(frozen=True)
class GGUFRows:
    """A weight in its GGUF blocks as the file stores them, on its device, for the Triton
    kernel (kernels/triton/quant_matmul.py)."""

    data: torch.Tensor  # uint8 [out_features, in_features / 32 * block_bytes(qtype)]
    qtype: int
    out_features: int
    in_features: int


def triton_reads_blocks(device: torch.device) -> bool:
    """Weights kept in blocks on `device` go to the Triton kernel as stored (CUDA, or
    PDSERVE_KERNEL_BACKEND=triton on CPU), not to this module's packed panels."""
    return device.type != "cpu" or backend.use_triton(device)


def kept_qtypes(device: torch.device) -> tuple[int, ...]:
    """The formats whose projections stay in blocks on `device`: the kernel's that reads them
    there (the others are dequantized at load)."""
    return TRITON_QTYPES if triton_reads_blocks(device) else tuple(QTYPES.values())


def block_bytes(qtype: int) -> int:
    """A GGUF row's bytes per 32 weights in format `qtype`."""
    return _BLOCK_BYTES[qtype]


@functools.cache
def available() -> bool:
    """The kernel is built, and the CPU has AVX-512 VNNI and BF16 (else the weights are
    dequantized at load, as before)."""
    lib = native.load("quant_linear_cpu")
    return lib is not None and lib.pdserve_quant_linear_available() == 1


def pack(raw: np.ndarray, qtype: int, out_features: int, in_features: int) -> QuantWeight:
    """`raw`: the GGUF tensor's bytes, `out_features` rows of in_features / 32 blocks."""
    multiple = _ROW_MULTIPLE.get(qtype, BLOCK)
    if in_features % multiple:
        raise ValueError(f"in_features={in_features} is not a multiple of {multiple}.")
    expected = out_features * in_features // BLOCK * block_bytes(qtype)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    assert raw.size == expected, f"{raw.size} bytes of blocks, expected {expected}"
    size = native.function("quant_linear_cpu", "pdserve_quant_packed_bytes", _INT, _I64, _I64)
    size.restype = ctypes.c_int64
    data = torch.empty(size(qtype, out_features, in_features), dtype=torch.uint8)
    fn = native.function("quant_linear_cpu", "pdserve_quant_pack", _P, _INT, _I64, _I64, _P)
    fn(raw.ctypes.data, qtype, out_features, in_features, data.data_ptr())
    return QuantWeight(data, qtype, out_features, in_features)


def quant_linear(
    x: torch.Tensor,
    weight: QuantWeight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x W^T + b in x's dtype (float32 or bfloat16), or in float32 (`out_dtype`: logits, the
    float32 sums never rounded to bf16)."""
    out_dtype = out_dtype or x.dtype
    assert out_dtype in (x.dtype, torch.float32), out_dtype
    k, n = weight.in_features, weight.out_features
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=out_dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    fn = native.function(
        "quant_linear_cpu", "pdserve_quant_linear", _INT, _INT, _P, _I64, _I64, _I64, _P, _INT,
        _I64, _P, _P, _I64, _INT,
    )  # fmt: skip
    fn(
        _DTYPES[x.dtype],
        int(out_dtype == torch.float32),
        x2.data_ptr(),
        x2.shape[0],
        k,
        x2.stride(0),
        weight.data.data_ptr(),
        weight.qtype,
        n,
        native.pointer(bias),
        out.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], n)
