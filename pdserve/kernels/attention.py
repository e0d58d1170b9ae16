"""Attention over the paged KV cache: the batch metadata, the torch reference and the dispatch.

A layer's KV cache is a view of shape [num_blocks, 2, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values) into the engine's block-major cache, so one block of every layer
is contiguous in memory (see docs/kv_cache.md). The Triton kernel is in triton/attention.py;
writes into the cache are in kv_cache.py.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels import backend
from pdserve.kernels.cpu import native
from pdserve.kernels.kv_cache import FP8_FORMATS, UNIT_SCALE, KVScale, dequantize_kv, inverse
from pdserve.utils import cdiv

if backend.HAS_TRITON:
    from pdserve.kernels.triton.attention import paged_attention_triton


@dataclass
class AttentionMetadata:
    """One step's batch: requests in order, their query tokens flattened into one sequence.

    Request i owns query tokens [query_start_loc[i], query_start_loc[i + 1]) and attends to
    its first seq_lens[i] cached tokens (context + this step's tokens), causally.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64; -1 = padding, not written
    # Models with recurrent state: each request's slot of the state caches (models/state_cache.py).
    state_slots: torch.Tensor | None = None  # [num_reqs] int64


def paged_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] against the paged cache.

    The reference pads every request's queries and gathered keys to the batch maximum and
    runs one masked SDPA (soft-capped scores: the same steps written out): simple and exact, at
    the cost of padding work.
    """
    num_reqs = md.num_reqs
    num_tokens = md.num_actual_tokens
    num_heads, head_dim = query.shape[1], query.shape[2]
    if num_reqs == 0:
        return query.new_empty(0, num_heads, head_dim)
    block_size = kv_cache.shape[2]
    num_blocks = cdiv(md.max_seq_len, block_size)
    max_kv = num_blocks * block_size
    device = query.device

    # index_select of keys and values separately is the fastest CPU gather (several times
    # faster than advanced indexing) and yields contiguous blocks, so the view below is free.
    block_ids = md.block_table[:num_reqs, :num_blocks].reshape(-1).long()
    num_kv_heads = kv_cache.shape[3]
    key = kv_cache[:, 0].index_select(0, block_ids).view(num_reqs, max_kv, num_kv_heads, head_dim)
    value = kv_cache[:, 1].index_select(0, block_ids).view(num_reqs, max_kv, num_kv_heads, head_dim)
    key = dequantize_kv(key, query.dtype, kv_scale[0])
    value = dequantize_kv(value, query.dtype, kv_scale[1])

    qsl = md.query_start_loc[: num_reqs + 1].long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = md.seq_lens[:num_reqs].long()
    max_q = md.max_query_len
    if max_q == 1:
        padded_q = query[:num_tokens].unsqueeze(1)
        token_req = token_pos = None
    else:
        token_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens)
        token_pos = torch.arange(num_tokens, device=device) - qsl[token_req]
        padded_q = query.new_zeros(num_reqs, max_q, num_heads, head_dim)
        padded_q[token_req, token_pos] = query[:num_tokens]

    q_positions = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=device)[None]
    k_positions = torch.arange(max_kv, device=device)
    mask = (k_positions[None, None, :] <= q_positions[:, :, None]) & (
        k_positions[None, None, :] < seq_lens[:, None, None]
    )
    if window:  # the last `window` keys, its own included
        mask &= k_positions[None, None, :] > q_positions[:, :, None] - window
    q, k, v = padded_q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if softcap:
        k, v = (x.repeat_interleave(num_heads // num_kv_heads, dim=1) for x in (k, v))
        scores = torch.matmul(q, k.transpose(2, 3)) * scale
        scores = (scores / softcap).tanh() * softcap
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=num_heads != num_kv_heads
        ).transpose(1, 2)
    if token_req is None:
        return out[:, 0]
    return out[token_req, token_pos]


_CPU_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class Geometry(ctypes.Structure):
    """Mirrors `Geometry` in csrc/paged_attention.h."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "block_size",
            "stride_q_token",
            "stride_out_token",
            "stride_block",
            "stride_kv",
            "stride_slot",
            "stride_block_table",
        )
    ] + [
        ("scale", ctypes.c_float),
        ("window", ctypes.c_int64),
        ("softcap", ctypes.c_float),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
        ("inv_k_scale", ctypes.c_float),
        ("inv_v_scale", ctypes.c_float),
    ]

    @classmethod
    def of(
        cls,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        num_heads: int,
        head_dim: int,
        stride_q_token: int,
        stride_out_token: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        kv_scale: KVScale = UNIT_SCALE,
    ) -> Geometry:
        """The kernel's view of a layer's cache (checked to be one), and of the batch's tables."""
        assert kv_cache.stride(4) == 1 and kv_cache.stride(3) == head_dim, (
            "a layer view of the cache"
        )
        block_table = md.block_table
        assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
        return cls(
            num_heads,
            kv_cache.shape[3],
            head_dim,
            kv_cache.shape[2],
            stride_q_token,
            stride_out_token,
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            block_table.stride(0),
            scale,
            window,
            softcap,
            *kv_scale,
            *(inverse(s) for s in kv_scale),
        )


@functools.cache
def _cpu_kernel() -> ctypes._CFuncPtr | None:
    lib = native.load("paged_attention_cpu")
    if lib is None:
        return None
    fn = lib.pdserve_paged_attention
    pointers = [ctypes.c_void_p] * 6
    fn.argtypes = [
        ctypes.c_int, ctypes.c_int, *pointers, ctypes.c_int64, ctypes.c_int,
        ctypes.POINTER(Geometry),
    ]  # fmt: skip
    fn.restype = ctypes.c_int
    return fn


def paged_attention_cpu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor | None:
    """The C++ kernel of csrc/paged_attention_cpu.cpp: reads keys and values through the block
    table in place, every query token against its keys in order whatever the batch (batch
    invariance: SDPA's padded tiles are not the default for any batch). None where it does not
    apply (dtype, no compiler; an fp8 cache: a CPU without AVX-512 BF16, a head size not a
    multiple of 32, groups of more than 8 query heads)."""
    dtype = _CPU_DTYPES.get(query.dtype)
    cache_format = FP8_FORMATS.get(kv_cache.dtype, 0)
    if dtype is None or (cache_format == 0 and kv_cache.dtype != query.dtype):
        return None
    kernel = _cpu_kernel()
    if kernel is None:
        return None
    num_heads, head_dim = query.shape[1], query.shape[2]
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        query = query.contiguous()
    out = query.new_empty(md.num_actual_tokens, num_heads, head_dim)
    geometry = Geometry.of(
        kv_cache, md, num_heads, head_dim, query.stride(0), out.stride(0), scale, window, softcap,
        kv_scale,
    )  # fmt: skip
    qsl, seq_lens = as_int32(md.query_start_loc), as_int32(md.seq_lens)
    ran = kernel(
        dtype,
        cache_format,
        query.data_ptr(),
        kv_cache.data_ptr(),
        md.block_table.data_ptr(),
        qsl.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        md.num_reqs,
        torch.get_num_threads(),
        ctypes.byref(geometry),
    )
    return out if ran else None


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels read it (itself where it already is: V2's tables are int32)."""
    return t.to(torch.int32).contiguous()


def rope_attention_cpu(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    num_heads: int,
    head_dim: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor | None:
    """A layer's attention from its q/k/v projection [T, (num_heads + 2 kv heads) head_dim] in one
    native call: rotary embedding, the cache write, paged attention, each the same code as its
    own kernel. Returns [T, num_heads * head_dim]; None where it does not apply (then the caller
    runs the three)."""
    if qkv.dtype != torch.bfloat16 or cos_sin_cache.dtype != torch.bfloat16:
        return None
    if md.num_actual_tokens != qkv.shape[0]:
        return None
    cache_format = FP8_FORMATS.get(kv_cache.dtype, 0)
    if qkv.dim() != 2 or qkv.stride(1) != 1 or (not cache_format and kv_cache.dtype != qkv.dtype):
        return None
    if md.slot_mapping.dtype != torch.int64 or not backend.use_cpu_kernels(qkv.device):
        return None
    fn = native.function(
        "paged_attention_cpu", "pdserve_rope_attention", ctypes.c_int, _P, _I64, _P, _P, _P, _P,
        _I64, _P, _P, _P, _P, _I64, ctypes.c_int, ctypes.POINTER(Geometry), restype=ctypes.c_int,
    )  # fmt: skip
    if fn is None:
        return None
    positions = positions.to(torch.int64).contiguous()
    table = cos_sin_cache.contiguous()
    slot_mapping = md.slot_mapping.contiguous()
    out = qkv.new_empty(qkv.shape[0], num_heads * head_dim)
    geometry = Geometry.of(
        kv_cache, md, num_heads, head_dim, 0, out.stride(0), scale, window, softcap, kv_scale
    )
    qsl, seq_lens = as_int32(md.query_start_loc), as_int32(md.seq_lens)
    ran = fn(
        cache_format,
        qkv.data_ptr(),
        qkv.stride(0),
        positions.data_ptr(),
        table.data_ptr(),
        kv_cache.data_ptr(),
        slot_mapping.data_ptr(),
        qkv.shape[0],
        md.block_table.data_ptr(),
        qsl.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        md.num_reqs,
        torch.get_num_threads(),
        ctypes.byref(geometry),
    )
    return out if ran else None


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] against the paged cache;
    returns [md.num_actual_tokens, num_heads, head_dim] in the query's dtype. `window`: a query
    sees its last `window` keys, itself included (0: all); `softcap`: scores become
    softcap * tanh(score / softcap) before the softmax (0: not); `kv_scale`: an fp8 cache's
    (k_scale, v_scale) (kv_cache.py)."""
    if backend.use_triton(query.device):
        return paged_attention_triton(
            query, kv_cache, md, scale, window=window, softcap=softcap, kv_scale=kv_scale
        )
    if backend.use_cpu_kernels(query.device):
        out = paged_attention_cpu(query, kv_cache, md, scale, window, softcap, kv_scale)
        if out is not None:
            return out
    return paged_attention_torch(query, kv_cache, md, scale, window, softcap, kv_scale)
