"""Linear layers on CPU with weights packed once, after loading, for csrc/linear_cpu.cpp.

Every bf16 or float32 matmul of a model runs that kernel, whatever the batch: bf16 on AMX tiles
where the CPU has them, else with AVX512-BF16 dot products; float32 with AVX-512 FMAs. Each
output element is summed over K in one fixed order and rounded once, so a request's results do
not depend on the other rows of its batch, its row or the thread count (batch invariance;
oneDNN's and MKL's kernels change their summation order with the number of rows, so `F.linear`
is not the default for any batch). A decode step is bound by reading each weight once, and the
packed panels stream at the memory's pace.

Where the kernel cannot be built, or PDSERVE_KERNEL_BACKEND=torch, `F.linear` runs (not batch
invariant; the build failure is logged once).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import envs
from pdserve.kernels import backend
from pdserve.kernels.cpu import native
from pdserve.kernels.quant_linear import GGUFRows, QuantWeight, quant_linear, triton_reads_blocks
from pdserve.kernels.quant_linear import pack as pack_quant
from pdserve.utils import cdiv

if backend.HAS_TRITON:
    from pdserve.kernels.triton.matmul import matmul_triton
    from pdserve.kernels.triton.quant_matmul import quant_matmul_torch, quant_matmul_triton

logger = logging.getLogger(__name__)

# The panel geometry of packed_linear.h: 32 features; bf16 K in blocks of 32.
BLOCK_N, BLOCK_K = 32, 32
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass(frozen=True)
class PackedWeight:
    data: torch.Tensor  # packed_linear.h's panels, in the weight's dtype
    out_features: int
    in_features: int


def _round_up(x: int, to: int) -> int:
    return cdiv(x, to) * to


@functools.cache
def amx_available() -> bool:
    """bf16 matmuls run on AMX tiles: the CPU has them and Linux granted this process their
    state (logged once if not)."""
    lib = native.load("linear_cpu")
    if lib is None:
        return False
    ready = lib.pdserve_amx_ready() == 1
    if not ready:
        logger.info("No AMX bf16 tiles on this CPU; bf16 matmuls use AVX512-BF16 dot products.")
    return ready


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.dtype in _DTYPES
        and backend.use_cpu_kernels(weight.device)
        and native.load("linear_cpu") is not None
    )


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """The weight [out, in] in packed_linear.h's panels."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        data = torch.empty(_round_up(n, BLOCK_N) * _round_up(k, BLOCK_K), dtype=weight.dtype)
        symbol = "pdserve_pack_bf16"
    else:
        data = torch.empty(_round_up(n, BLOCK_N) * k, dtype=weight.dtype)
        symbol = "pdserve_pack_f32"
    pack = native.function("linear_cpu", symbol, _P, _I64, _I64, _P)
    pack(weight.contiguous().data_ptr(), n, k, data.data_ptr())
    return PackedWeight(data, n, k)


def _packed_linear(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    k, n = packed.in_features, packed.out_features
    x2 = x.reshape(-1, k)
    if x2.dtype != packed.data.dtype:
        x2 = x2.to(packed.data.dtype)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    bf16 = packed.data.dtype == torch.bfloat16
    if bf16 and k % BLOCK_K:
        x2 = F.pad(x2, (0, BLOCK_K - k % BLOCK_K))
    out = torch.empty((x2.shape[0], n), dtype=out_dtype)
    fn = native.function(
        "linear_cpu", "pdserve_linear", _INT, _INT, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64,
        _INT,
    )  # fmt: skip
    fn(
        _DTYPES[packed.data.dtype],
        int(out_dtype == torch.float32),
        x2.data_ptr(),
        x2.shape[0],
        x2.shape[1],
        x2.stride(0),
        packed.data.data_ptr(),
        n,
        native.pointer(bias),
        out.data_ptr(),
        n,
        torch.get_num_threads(),
    )
    return out.view(*x.shape[:-1], n)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: PackedWeight | QuantWeight | GGUFRows | None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x W^T + b in the weight's dtype, or in `out_dtype` (float32 for logits: the kernel's
    float32 sums, not rounded to bf16 first). On CUDA, cuBLAS; under PDSERVE_BATCH_INVARIANT the
    Triton matmul of triton/matmul.py, whose rows do not depend on the batch. A weight kept in
    GGUF blocks: in x's dtype or float32, on CPU by kernels/quant_linear.py, elsewhere by the
    Triton dequantize-matmul (triton/quant_matmul.py; its torch reference where the torch
    backend is forced)."""
    if isinstance(packed, QuantWeight):
        return quant_linear(x, packed, bias, out_dtype)
    if isinstance(packed, GGUFRows):
        matmul = quant_matmul_triton if backend.use_triton(x.device) else quant_matmul_torch
        return matmul(x, packed, bias, out_dtype or x.dtype)
    out_dtype = out_dtype or weight.dtype
    if packed is not None and x.numel():
        return _packed_linear(x, packed, bias, out_dtype)
    if x.device.type == "cuda":
        if envs.batch_invariant():
            return matmul_triton(x, weight, bias, out_dtype)
        if out_dtype != weight.dtype:
            # cuBLAS writes its float32 sums itself: no float32 copy of the weight per call.
            logits = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=out_dtype)
            if bias is not None:
                logits += bias.to(out_dtype)
            return logits.view(*x.shape[:-1], weight.shape[0])
    if out_dtype == weight.dtype:
        return F.linear(x, weight, bias)
    # One rounding, as the kernel's: float32 sums of the weight's values.
    return F.linear(x.to(out_dtype), weight.to(out_dtype), None if bias is None else bias.float())


def pack_linear_weights(model: nn.Module) -> int:
    """Pack the weight of every module that takes one (`packed_weight` attribute), and each
    expert's of an MoE layer (`packed_experts`); returns how many were packed. The dense weight
    stays: checkpoints, tied embeddings and the KV-free reference paths read it."""
    num_packed = num_rows = 0
    lm_head = getattr(model, "lm_head", None)
    for module in model.modules():
        # An embedding table (it has compute_logits) is a matmul only as the LM head.
        if hasattr(module, "compute_logits") and module is not lm_head:
            continue
        blocks = getattr(module, "gguf_blocks", None)
        qtype = getattr(getattr(module, "weight", None), "gguf_qtype", None)
        if blocks is not None:  # an LM head kept in its GGUF blocks
            rows, block_type = blocks
            rows = rows.to(module.weight.device)
            module.packed_weight = _pack_blocks(rows, block_type, module.weight.shape[1])
            module.gguf_blocks = None
            num_rows += isinstance(module.packed_weight, GGUFRows)
            num_packed += 1
        elif hasattr(module, "packed_weight") and qtype is not None:
            module.packed_weight = _pack_blocks(module.weight.data, qtype, module.in_features)
            num_rows += isinstance(module.packed_weight, GGUFRows)
            num_packed += 1
        elif hasattr(module, "packed_weight") and can_pack(module.weight):
            module.packed_weight = pack_weight(module.weight)
            num_packed += 1
        elif hasattr(module, "packed_experts") and can_pack(module.w13_weight):
            module.packed_experts = [
                (pack_weight(w13), pack_weight(w2))
                for w13, w2 in zip(module.w13_weight, module.w2_weight, strict=True)
            ]
            num_packed += 2 * len(module.packed_experts)
    if num_rows:
        logger.info("%d linear weights in GGUF blocks for the Triton kernel.", num_rows)
    if num_packed > num_rows:
        kind = "AMX" if amx_available() else "AVX-512"
        logger.info("Packed %d linear weights (bf16 on %s).", num_packed - num_rows, kind)
    return num_packed


def _pack_blocks(rows: torch.Tensor, qtype: int, in_features: int) -> QuantWeight | GGUFRows:
    """A weight's GGUF rows of blocks for the kernel that reads them on their device: the
    Triton kernel takes them as they are, the CPU kernel in its panels."""
    if triton_reads_blocks(rows.device):
        return GGUFRows(rows, qtype, rows.shape[0], in_features)
    return pack_quant(rows.numpy(), qtype, rows.shape[0], in_features)
