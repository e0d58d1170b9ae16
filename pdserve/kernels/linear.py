"""Linear layers on CPU with weights packed once, after loading, for the kernel that reads them.

Where the CPU has AMX, a decode-sized batch (up to AMX_MAX_ROWS rows) runs csrc/linear_cpu.cpp,
whose weights are packed in the order its tiles read them: a decode step is bound by reading
every weight once, and that kernel streams them 1.2-1.4x faster than oneDNN does here. Larger
batches (prefill) run `F.linear`, whose oneDNN kernels are faster there. Its results are the
float32 sum rounded once, as oneDNN's are, but summed in its own order: not oneDNN's bits.

Without AMX (AVX512-BF16 only), the weight is packed into oneDNN's blocked layout instead:
`F.linear` on bf16 CPU tensors reorders the weight on every call, and packing it once (vLLM's
process_weights_after_loading) makes decode-sized matmuls 30-60% faster, bit for bit the same.
float32 keeps `F.linear`, whose results are the reference's to the bit.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import backend, native

logger = logging.getLogger(__name__)

# Above this many rows oneDNN's kernels beat the AMX kernel (its activations no longer stay in L2).
AMX_MAX_ROWS = 128
# The panel geometry of linear_cpu.cpp: 32 features by blocks of 32 k.
AMX_BLOCK_N, AMX_BLOCK_K = 32, 32

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor
    out_features: int
    in_features: int
    amx: bool  # csrc/linear_cpu.cpp's panels; otherwise oneDNN's blocked layout


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


@functools.cache
def amx_available() -> bool:
    """AMX's bf16 tiles exist and Linux granted this process their state (logged once if not)."""
    lib = native.load("linear_cpu")
    if lib is None:
        return False
    status = lib.pdserve_amx_enable()
    if status != 0:
        logger.info("No AMX bf16 tiles on this CPU; decode matmuls use oneDNN's packed weights.")
    return status == 0


def can_pack(weight: torch.Tensor) -> bool:
    if weight.dtype != torch.bfloat16 or not backend.use_cpu_kernels(weight.device):
        return False
    return amx_available() or (
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_weight(weight: torch.Tensor, batch_size_hint: int) -> PackedWeight:
    """The weight [out, in] packed for AMX, or for oneDNN batches of about `batch_size_hint`."""
    n, k = weight.shape
    if not amx_available():
        data = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)
        return PackedWeight(data, n, k, amx=False)
    data = torch.empty(_round_up(n, AMX_BLOCK_N) * _round_up(k, AMX_BLOCK_K), dtype=torch.bfloat16)
    pack = native.function("linear_cpu", "pdserve_amx_pack", _P, _I64, _I64, _P)
    pack(weight.contiguous().data_ptr(), n, k, data.data_ptr())
    return PackedWeight(data, n, k, amx=True)


def _amx_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    k, n = packed.in_features, packed.out_features
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if k % AMX_BLOCK_K:
        x2 = F.pad(x2, (0, AMX_BLOCK_K - k % AMX_BLOCK_K))
    out = torch.empty((x2.shape[0], n), dtype=torch.bfloat16)
    fn = native.function(
        "linear_cpu", "pdserve_amx_linear", _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _INT
    )
    fn(
        x2.data_ptr(),
        x2.shape[0],
        x2.shape[1],
        x2.stride(0),
        packed.data.data_ptr(),
        n,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], n)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    if not packed.amx:
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    rows = x.numel() // packed.in_features
    if 0 < rows <= AMX_MAX_ROWS and x.dtype == torch.bfloat16:
        return _amx_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def pack_linear_weights(model: nn.Module, batch_size_hint: int) -> int:
    """Pack the weight of every module that takes one (`packed_weight` attribute); returns how
    many were packed. The dense weight stays: prefill batches, checkpoints, tied embeddings and
    the KV-free reference paths read it."""
    num_packed = 0
    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        # An embedding table (it has compute_logits) is a matmul only as the LM head.
        if hasattr(module, "compute_logits") and module is not lm_head:
            continue
        if hasattr(module, "packed_weight") and can_pack(module.weight):
            module.packed_weight = pack_weight(module.weight, batch_size_hint)
            num_packed += 1
    if num_packed:
        kind = "AMX" if amx_available() else "oneDNN"
        logger.info("Packed %d linear weights for %s.", num_packed, kind)
    return num_packed
