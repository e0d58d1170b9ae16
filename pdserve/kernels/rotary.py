"""Rotary position embedding of query and key in one launch (HF's rotate_half layout).

cos and sin come from a table [max_position, 2, head_dim] built once per model by
`build_cos_sin_cache`, in the model's dtype: row p holds HF's cos(p * inv_freq) repeated
over both halves, and sin with the first half negated. With the sign folded into the table,
HF's `x * cos + rotate_half(x) * sin` becomes `x * cos + roll(x, head_dim / 2) * sin`, the same
products and sums, so the same bits. No cos or sin is evaluated per step: the table holds
exactly what HF computes on that device, where an in-kernel cos would round differently.
"""

from __future__ import annotations

import torch

from pdserve.kernels import backend
from pdserve.kernels.cpu import elementwise as elementwise_cpu

if backend.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate_heads(
        src,
        dst,
        stride_h,
        num_heads,
        cos,
        sin,
        offs_d,
        rolled,
        mask_d,
        head_dim,
        BLOCK_H: tl.constexpr,
    ):
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        mask = (offs_h < num_heads) & mask_d[None, :]
        x = tl.load(src + offs_h * stride_h + offs_d[None, :], mask=mask)
        x_rolled = tl.load(src + offs_h * stride_h + rolled[None, :], mask=mask)
        dtype = x.dtype
        # Each product is rounded to the activation dtype before the sum, as torch's ops are.
        a = (x.to(tl.float32) * cos[None, :]).to(dtype)
        b = (x_rolled.to(tl.float32) * sin[None, :]).to(dtype)
        out = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
        tl.store(dst + offs_h * head_dim + offs_d[None, :], out, mask=mask)

    @triton.jit
    def _rotary_kernel(
        positions_ptr,
        query_ptr,
        key_ptr,
        cache_ptr,
        query_out_ptr,
        key_out_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        num_heads,
        num_kv_heads,
        head_dim,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # One program per token: its cos/sin row is loaded once for all query and key heads.
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions_ptr + token).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        rolled = (offs_d + head_dim // 2) % head_dim
        row = cache_ptr + pos * 2 * head_dim
        # Rounded to the activation dtype first, as the reference casts the table it gathers.
        dtype = query_out_ptr.dtype.element_ty
        cos = tl.load(row + offs_d, mask=mask_d).to(dtype)
        sin = tl.load(row + head_dim + offs_d, mask=mask_d).to(dtype)
        cos, sin = cos.to(tl.float32), sin.to(tl.float32)
        q_src = query_ptr + token * stride_qt
        q_dst = query_out_ptr + token * num_heads * head_dim
        k_src = key_ptr + token * stride_kt
        k_dst = key_out_ptr + token * num_kv_heads * head_dim
        _rotate_heads(
            q_src, q_dst, stride_qh, num_heads, cos, sin, offs_d, rolled, mask_d, head_dim, BLOCK_HQ
        )
        _rotate_heads(
            k_src,
            k_dst,
            stride_kh,
            num_kv_heads,
            cos,
            sin,
            offs_d,
            rolled,
            mask_d,
            head_dim,
            BLOCK_HK,
        )


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, dtype: torch.dtype, attention_factor: float = 1.0
) -> torch.Tensor:
    """The [max_position, 2, head_dim] table on the current default device (where HF would
    compute it), from the float32 inverse frequencies [head_dim / 2]; YaRN scales cos and sin
    by its attention factor."""
    positions = torch.arange(max_position, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1).to(dtype)


def rotary_embedding_torch(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache.index_select(0, positions).to(query.dtype)
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
    # Query and key rotated as one tensor: half the small ops, which dominate on CPU.
    qk = torch.cat((query, key), dim=1)
    out = qk * cos + qk.roll(query.shape[-1] // 2, dims=-1) * sin
    return out[:, : query.shape[1]], out[:, query.shape[1] :]


def rotary_embedding_triton(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    assert cos_sin_cache.is_contiguous() and cos_sin_cache.shape[1:] == (2, head_dim)
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            positions,
            query,
            key,
            cos_sin_cache,
            query_out,
            key_out,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            num_heads,
            num_kv_heads,
            head_dim,
            BLOCK_HQ=triton.next_power_of_2(num_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return query_out, key_out


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, num_heads, head_dim] and key [T, num_kv_heads, head_dim] by positions
    [T] (int64, each below the table's max_position)."""
    if backend.use_triton(query.device):
        return rotary_embedding_triton(positions, query, key, cos_sin_cache)
    if (cpu := elementwise_cpu.rotary_embedding(positions, query, key, cos_sin_cache)) is not None:
        return cpu
    return rotary_embedding_torch(positions, query, key, cos_sin_cache)
