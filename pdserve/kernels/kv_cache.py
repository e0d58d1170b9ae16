"""Writes of one step's keys and values into the paged KV cache.

A layer's cache is the view [num_blocks, 2, block_size, num_kv_heads, head_dim] (index 0 keys,
1 values) of the block-major engine cache, so it is not contiguous: the kernel takes strides.
Slot s is position s % block_size of block s // block_size; slot -1 marks a padding token.

An fp8 cache (--kv-cache-dtype) stores each key x as x / k_scale (values v / v_scale), rounded to
nearest even and saturated at the format's largest finite value; readers multiply back. The
scales are per layer, `kv_scale = (k_scale, v_scale)`, 1.0 unless the checkpoint has its own.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pdserve.kernels import backend
from pdserve.kernels.cpu import native

# The largest finite value of each fp8 format.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
KVScale = tuple[float, float]
UNIT_SCALE: KVScale = (1.0, 1.0)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a cache of `dtype` stores it. The reciprocal is one float32 constant (what the
    kernels multiply by), so every path stores the same bytes."""
    limit = FP8_MAX.get(dtype)
    if limit is None:
        return x.to(dtype)
    return (x.float() * inverse(scale)).clamp(-limit, limit).to(dtype)


# Cached: every attention call's geometry asks for its layer's two (1.0 for a bf16 cache).
@functools.cache
def inverse(scale: float) -> float:
    """1 / scale rounded to float32, the factor the kernels store with."""
    return float(torch.tensor(1.0 / scale, dtype=torch.float32))


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached keys or values x back in `dtype` (the activations')."""
    if x.dtype not in FP8_MAX:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


if backend.HAS_TRITON:
    import triton
    import triton.language as tl

    from pdserve.kernels.triton.fp8 import to_fp8

    @triton.jit
    def _write_kv_cache_kernel(
        key_ptr,
        value_ptr,
        cache_ptr,
        slot_mapping_ptr,
        inv_k_scale,
        inv_v_scale,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_cb,
        stride_ckv,
        stride_cs,
        stride_ch,
        stride_cd,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        FP8_MAX: tl.constexpr,  # an fp8 cache's largest value; 0.0: the cache is not fp8
    ):
        # One program per token, all heads at once: a token's K and V are one tile each.
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        # Constexpr bounds: the mask folds away when the shape is a power of two.
        mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
        key = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d * stride_kd, mask)
        value = tl.load(
            value_ptr + token * stride_vt + offs_h * stride_vh + offs_d * stride_vd, mask
        )
        dst = cache_ptr + block * stride_cb + offset * stride_cs
        dst += offs_h * stride_ch + offs_d * stride_cd
        dtype = cache_ptr.dtype.element_ty
        if FP8_MAX > 0:
            key = to_fp8(key.to(tl.float32) * inv_k_scale, FP8_MAX, dtype)
            value = to_fp8(value.to(tl.float32) * inv_v_scale, FP8_MAX, dtype)
        tl.store(dst, key.to(dtype), mask=mask)
        tl.store(dst + stride_ckv, value.to(dtype), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots (Triton); into an fp8
    cache as quantize_kv does, bit for bit."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        *(inverse(s) for s in kv_scale),
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=FP8_MAX.get(kv_cache.dtype, 0.0),
    )


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots (torch reference)."""
    num_tokens = slot_mapping.shape[0]
    key, value = key[:num_tokens], value[:num_tokens]
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    block_idx = slot_mapping // block_size
    block_off = slot_mapping % block_size
    kv_cache[block_idx, 0, block_off] = quantize_kv(key, kv_cache.dtype, kv_scale[0])
    if kv_cache.stride(1):  # else one entry is key and value (a latent cache): written once
        kv_cache[block_idx, 1, block_off] = quantize_kv(value, kv_cache.dtype, kv_scale[1])


class _Strides(ctypes.Structure):
    """Mirrors `KVStrides` in csrc/kv_cache.h (in elements)."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "key_token",
            "key_head",
            "value_token",
            "value_head",
            "block",
            "kv",
            "slot",
            "head",
        )
    ]


_I64, _P = ctypes.c_int64, ctypes.c_void_p


# The fp8 formats' codes in the C kernels (0: the cache holds the activations' dtype).
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_ACT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def write_kv_cache_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: KVScale = UNIT_SCALE,
) -> bool:
    """The copy of csrc/kv_cache_cpu.cpp (into an fp8 cache, the conversion); False where it
    does not apply (another conversion, a head whose elements are not adjacent, no compiler)."""
    fp8 = FP8_FORMATS.get(kv_cache.dtype)
    if key.dtype != value.dtype or key.stride(2) != 1 or value.stride(2) != 1:
        return False
    if (fp8 is None and key.dtype != kv_cache.dtype) or (fp8 and key.dtype not in _ACT_DTYPES):
        return False
    if kv_cache.stride(4) != 1 or slot_mapping.dtype != torch.int64:
        return False
    if fp8:
        fn = native.function(
            "kv_cache_cpu", "pdserve_write_kv_cache_fp8", ctypes.c_int, ctypes.c_int, _P, _P, _P,
            _P, _I64, _I64, _I64, _I64, ctypes.POINTER(_Strides), ctypes.c_float,
            ctypes.c_float, ctypes.c_int,
        )  # fmt: skip
    else:
        fn = native.function(
            "kv_cache_cpu", "pdserve_write_kv_cache", _P, _P, _P, _P, _I64, _I64, _I64, _I64,
            _I64, ctypes.POINTER(_Strides), ctypes.c_int,
        )  # fmt: skip
    if fn is None:
        return False
    slot_mapping = slot_mapping.contiguous()
    strides = _Strides(*key.stride()[:2], *value.stride()[:2], *kv_cache.stride()[:4])
    pointers = (key.data_ptr(), value.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr())
    tokens, heads, dim = slot_mapping.shape[0], key.shape[1], key.shape[2]
    threads = torch.get_num_threads()
    if fp8:
        inv_k, inv_v = (inverse(s) for s in kv_scale)
        fn(_ACT_DTYPES[key.dtype], fp8, *pointers, tokens, heads, dim, kv_cache.shape[2],
           ctypes.byref(strides), inv_k, inv_v, threads)  # fmt: skip
    else:
        size = key.element_size()
        fn(*pointers, tokens, heads, dim * size, kv_cache.shape[2], size, ctypes.byref(strides),
           threads)  # fmt: skip
    return True


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: KVScale = UNIT_SCALE,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots; rows of key/value
    past len(slot_mapping) (batch padding) and slots -1 are not written."""
    if backend.use_triton(kv_cache.device):
        write_kv_cache_triton(key, value, kv_cache, slot_mapping, kv_scale)
    elif not (
        backend.use_cpu_kernels(kv_cache.device)
        and write_kv_cache_cpu(key, value, kv_cache, slot_mapping, kv_scale)
    ):
        write_kv_cache_torch(key, value, kv_cache, slot_mapping, kv_scale)
