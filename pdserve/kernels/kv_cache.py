"""Writes of one step's keys and values into the paged KV cache.

A layer's cache is the view [num_blocks, 2, block_size, num_kv_heads, head_dim] (index 0 keys,
1 values) of the block-major engine cache, so it is not contiguous: the kernel takes strides.
Slot s is position s % block_size of block s // block_size; slot -1 marks a padding token.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels import backend
from pdserve.kernels.cpu import native

if backend.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _write_kv_cache_kernel(
        key_ptr,
        value_ptr,
        cache_ptr,
        slot_mapping_ptr,
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
        tl.store(dst, key.to(dtype), mask=mask)
        tl.store(dst + stride_ckv, value.to(dtype), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots (Triton)."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_cache_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
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
    kv_cache[block_idx, 0, block_off] = key.to(kv_cache.dtype)
    if kv_cache.stride(1):  # else one entry is key and value (a latent cache): written once
        kv_cache[block_idx, 1, block_off] = value.to(kv_cache.dtype)


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


def write_kv_cache_cpu(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """The copy of csrc/kv_cache_cpu.cpp; False where it does not apply (a dtype conversion, a
    head whose elements are not adjacent, no compiler)."""
    if not (key.dtype == value.dtype == kv_cache.dtype and key.stride(2) == value.stride(2) == 1):
        return False
    if kv_cache.stride(4) != 1 or slot_mapping.dtype != torch.int64:
        return False
    fn = native.function(
        "kv_cache_cpu", "pdserve_write_kv_cache", _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64,
        ctypes.POINTER(_Strides), ctypes.c_int,
    )  # fmt: skip
    if fn is None:
        return False
    slot_mapping = slot_mapping.contiguous()
    strides = _Strides(
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
    )
    fn(
        key.data_ptr(),
        value.data_ptr(),
        kv_cache.data_ptr(),
        slot_mapping.data_ptr(),
        slot_mapping.shape[0],
        key.shape[1],
        key.shape[2] * key.element_size(),
        kv_cache.shape[2],
        key.element_size(),
        ctypes.byref(strides),
        torch.get_num_threads(),
    )
    return True


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots; rows of key/value
    past len(slot_mapping) (batch padding) and slots -1 are not written."""
    if backend.use_triton(kv_cache.device):
        write_kv_cache_triton(key, value, kv_cache, slot_mapping)
    elif not (
        backend.use_cpu_kernels(kv_cache.device)
        and write_kv_cache_cpu(key, value, kv_cache, slot_mapping)
    ):
        write_kv_cache_torch(key, value, kv_cache, slot_mapping)
