"""A Llama decoder stack's step in one call into csrc/decoder_cpu.cpp, in bf16 (AMX or
AVX512-BF16; projections kept in GGUF blocks through csrc/quant_linear.h).

Per layer it runs what the model's per-layer path runs through cpu/norm_linear.py, the fused
rotary + attention call and the packed linear: the same C code, so the same bits, without the
Python between the calls, which in the engine costs more than the kernels it calls (the
weights streaming past evict the interpreter's state). Decode-sized batches only; the caller
runs its layers one by one wherever `DecoderStack.forward` returns None.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kernels import backend
from pdserve.kernels.attention import AttentionMetadata, Geometry, as_int32
from pdserve.kernels.cpu import native
from pdserve.kernels.kv_cache import FP8_FORMATS, KVScale, inverse
from pdserve.kernels.linear import BLOCK_K, PackedWeight
from pdserve.kernels.quant_linear import QuantWeight

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _LayerWeights(ctypes.Structure):
    """Mirrors `LayerWeights` in csrc/decoder_cpu.cpp."""

    _fields_ = [
        *(
            (name, _P)
            for name in (
                "input_norm", "qkv", "qkv_bias", "o", "o_bias",
                "post_norm", "gate_up", "gate_up_bias", "down", "down_bias",
            )
        ),
        *((name, _I64) for name in ("qkv_type", "o_type", "gate_up_type", "down_type")),
    ]  # fmt: skip


class _StackShape(ctypes.Structure):
    """Mirrors `StackShape` in csrc/decoder_cpu.cpp."""

    _fields_ = [
        *(
            (name, _I64)
            for name in ("hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim")
        ),
        ("eps", _F),
        ("scale", _F),
    ]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the stack reads it: norms' weights, projections bf16-packed or in
    GGUF blocks."""

    input_norm: torch.Tensor
    qkv: PackedWeight | QuantWeight
    qkv_bias: torch.Tensor | None
    o: PackedWeight | QuantWeight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: PackedWeight | QuantWeight
    gate_up_bias: torch.Tensor | None
    down: PackedWeight | QuantWeight
    down_bias: torch.Tensor | None


class DecoderStack:
    """The layers of one pipeline stage, their pointers gathered once."""

    def __init__(
        self,
        layers: list[LayerWeights],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        cos_sin_cache: torch.Tensor,
        kv_scales: Callable[[], list[KVScale]],
    ) -> None:
        """kv_scales: the layers' (k_scale, v_scale) for an fp8 cache, as they are now."""
        self.layers = layers  # kept: the pointers below are into these tensors
        self.hidden = layers[0].input_norm.shape[0]
        self.cos_sin_cache = cos_sin_cache.contiguous()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.shape = _StackShape(
            self.hidden, layers[0].down.in_features, num_heads, num_kv_heads, head_dim, eps, scale
        )
        self.weights = (_LayerWeights * len(layers))(
            *(
                _LayerWeights(
                    native.pointer(w.input_norm),
                    native.pointer(w.qkv.data),
                    native.pointer(w.qkv_bias),
                    native.pointer(w.o.data),
                    native.pointer(w.o_bias),
                    native.pointer(w.post_norm),
                    native.pointer(w.gate_up.data),
                    native.pointer(w.gate_up_bias),
                    native.pointer(w.down.data),
                    native.pointer(w.down_bias),
                    *(_qtype(p) for p in (w.qkv, w.o, w.gate_up, w.down)),
                )  # fmt: skip
                for w in layers
            )
        )
        self._caches: tuple[list[int], ctypes.Array] | None = None
        # Read at each fp8 step: a layer's scales may be set after the stack is built
        # (runners/kv_scales.py's calibration runs through it).
        self.kv_scales = kv_scales
        self._kv_scales: tuple[list[KVScale], ctypes.Array] | None = None

    @staticmethod
    def available(layers: list[LayerWeights]) -> bool:
        """Every projection bf16-packed with whole 32-k blocks or in GGUF blocks, and the
        library built with AVX512-BF16."""
        projections = [p for w in layers for p in (w.qkv, w.o, w.gate_up, w.down)]
        if not layers or not all(
            isinstance(p, QuantWeight)
            or (p.data.dtype == torch.bfloat16 and p.in_features % BLOCK_K == 0)
            for p in projections
        ):
            return False
        lib = native.load("decoder_cpu")
        return lib is not None and lib.pdserve_decoder_layers_available() == 1

    def _cache_pointers(self, kv_caches: list[torch.Tensor]) -> ctypes.Array:
        pointers = [c.data_ptr() for c in kv_caches]
        if self._caches is None or self._caches[0] != pointers:
            # The kernel reads every layer with the first one's strides: views of one cache.
            assert all(c.stride() == kv_caches[0].stride() for c in kv_caches)
            self._caches = (pointers, (_P * len(pointers))(*pointers))
        return self._caches[1]

    def _scale_array(self) -> ctypes.Array:
        """Each layer's k_scale, v_scale and their reciprocals, as the kernel reads them."""
        scales = self.kv_scales()
        if self._kv_scales is None or self._kv_scales[0] != scales:
            values = [x for kv in scales for x in (*kv, *(inverse(s) for s in kv))]
            self._kv_scales = (scales, (_F * len(values))(*values))
        return self._kv_scales[1]

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last MLP's output, the residual stream), or None where the batch does not apply."""
        rows = hidden.shape[0]
        if rows == 0:
            return None
        if (
            md.num_actual_tokens != rows
            or hidden.dtype != torch.bfloat16
            or not hidden.is_contiguous()
        ):
            return None
        if residual is not None and not (
            residual.dtype == torch.bfloat16 and residual.is_contiguous()
        ):
            return None
        cache = kv_caches[0]
        cache_format = FP8_FORMATS.get(cache.dtype, 0)
        if not cache_format and cache.dtype != torch.bfloat16:
            return None
        # fp8 codes are attended on the vector path only (csrc/paged_attention_cpu.cpp).
        group = self.num_heads // self.shape.num_kv_heads
        if cache_format and (self.head_dim % 32 or group > 8):
            return None
        if md.slot_mapping.dtype != torch.int64:
            return None
        if not backend.use_cpu_kernels(hidden.device) or len(kv_caches) != len(self.layers):
            return None
        fn = native.function(
            "decoder_cpu", "pdserve_decoder_layers", _P, _P, _INT, _P, _I64,
            ctypes.POINTER(_StackShape),
            ctypes.POINTER(Geometry), _P, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _INT,
        )  # fmt: skip
        geometry = Geometry.of(
            cache, md, self.num_heads, self.head_dim, 0, self.num_heads * self.head_dim,
            self.shape.scale,
        )  # fmt: skip
        positions = positions.to(torch.int64).contiguous()
        slot_mapping = md.slot_mapping.contiguous()
        qsl, seq_lens = as_int32(md.query_start_loc), as_int32(md.seq_lens)
        hidden_out = torch.empty((rows, self.hidden), dtype=torch.bfloat16)
        residual_out = torch.empty((rows, self.hidden), dtype=torch.bfloat16)
        fn(
            self.weights,
            self._cache_pointers(kv_caches),
            cache_format,
            self._scale_array() if cache_format else None,
            len(self.layers),
            ctypes.byref(self.shape),
            ctypes.byref(geometry),
            hidden.data_ptr(),
            native.pointer(residual),
            rows,
            positions.data_ptr(),
            self.cos_sin_cache.data_ptr(),
            slot_mapping.data_ptr(),
            md.block_table.data_ptr(),
            qsl.data_ptr(),
            seq_lens.data_ptr(),
            md.num_reqs,
            hidden_out.data_ptr(),
            residual_out.data_ptr(),
            torch.get_num_threads(),
        )
        return hidden_out, residual_out


def _qtype(weight: PackedWeight | QuantWeight) -> int:
    """The kernel's type of a projection: 0 bf16-packed, else its GGUF type."""
    return weight.qtype if isinstance(weight, QuantWeight) else 0
