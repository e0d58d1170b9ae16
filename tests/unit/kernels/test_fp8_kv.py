"""An fp8 KV cache on CPU (csrc/fp8.h): the C++ write stores the torch reference's bytes, and the
C++ attention over fp8 codes matches the reference over the same codes, batch invariant, also
in the fused rotary + write + attention call."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.attention import paged_attention_cpu, paged_attention_torch
from pdserve.kernels.cpu import native
from pdserve.kernels.kv_cache import (
    FP8_MAX,
    quantize_kv,
    write_kv_cache_cpu,
    write_kv_cache_torch,
)
from tests.unit.kernels.test_attention import MIXED, _batch, _select
from tests.unit.kernels.test_attention_cpu import _qkv_batch, check_rope_attention

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# float32-representable scales: the kernels and torch then multiply by the same reciprocal.
SCALES = [(1.0, 1.0), (0.5, 4.0), (float(torch.tensor(0.3)), float(torch.tensor(1.7)))]

needs_compiler = pytest.mark.skipif(not native.compiler_available(), reason="no C++ compiler")
needs_bf16 = pytest.mark.skipif(
    not native.compiler_available() or not native.cpu_has("avx512_bf16"),
    reason="no C++ compiler, or a CPU without AVX-512 BF16 (fp8 attention's vector path)",
)


def _hard_values(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Values over every range of both formats: ties, subnormals, the largest and past it."""
    gen = torch.Generator().manual_seed(1)
    exponents = torch.randint(-24, 18, (n,), generator=gen).float()
    values = torch.randn(n, generator=gen) * torch.exp2(exponents)
    edges = [448.0, 464.0, 480.0, 1e6, 57344.0, 61440.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10]
    edges += [2.0**-16, 2.0**-17, 1.0625, 1.1875, 0.0, -0.0, 2.0**-130]
    values[: len(edges)] = torch.tensor(edges)
    values[len(edges) : 2 * len(edges)] = -torch.tensor(edges)
    return values.to(dtype)


@needs_compiler
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("kv_scale", SCALES)
def test_cpu_write_stores_the_reference_bytes(act, fp8, kv_scale) -> None:
    tokens, heads, dim, block_size = 40, 3, 64, 16
    key = _hard_values(tokens * heads * dim, act).view(tokens, heads, dim)
    value = key.flip(0) * 3
    slots = torch.randperm(4 * block_size, generator=torch.Generator().manual_seed(2))[:tokens]
    slots[5] = -1  # a padding token: not written
    cache = torch.zeros(4, 2, block_size, heads, dim, dtype=fp8)
    expected = cache.clone()
    assert write_kv_cache_cpu(key, value, cache, slots, kv_scale)
    write_kv_cache_torch(key, value, expected, slots, kv_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    # Saturated, never a NaN: torch's own conversion of what is past the largest value is not.
    assert cache.float().abs().max() == FP8_MAX[fp8]


def _fp8_batch(fp8: torch.dtype, kv_scale, **kwargs):
    """_batch's query, metadata and cache, the cache's keys and values stored as fp8 codes."""
    query, cache, md = _batch(MIXED, dtype=torch.bfloat16, **kwargs)
    codes = torch.stack([quantize_kv(cache[:, i], fp8, kv_scale[i]) for i in (0, 1)], dim=1)
    return query, codes, md


@needs_bf16
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize(("group", "head_dim"), [(1, 32), (3, 64), (8, 128)])
@pytest.mark.parametrize("kv_scale", SCALES[1:])
def test_attention_over_fp8_codes_matches_the_reference(fp8, group, head_dim, kv_scale) -> None:
    """Against the reference over the same codes (dequantized exactly), in float32; each
    query's bits the same alone as in its batch."""
    query, cache, md = _fp8_batch(fp8, kv_scale, group=group, head_dim=head_dim, block_size=4)
    scale = head_dim**-0.5
    out = paged_attention_cpu(query, cache, md, scale, kv_scale=kv_scale)
    assert out is not None and out.dtype == torch.bfloat16
    expected = paged_attention_torch(query.float(), cache, md, scale, kv_scale=kv_scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    for i in range(md.num_reqs):
        alone_query, alone = _select(query, md, [i])
        alone_out = paged_attention_cpu(alone_query, cache, alone, scale, kv_scale=kv_scale)
        start, end = int(md.query_start_loc[i]), int(md.query_start_loc[i + 1])
        assert torch.equal(alone_out, out[start:end])


@needs_bf16
def test_fp8_attention_leaves_other_shapes_to_the_reference() -> None:
    query, cache, md = _fp8_batch(torch.float8_e4m3fn, (1.0, 1.0), head_dim=24)
    assert paged_attention_cpu(query, cache, md, 0.2) is None  # head size not a multiple of 32
    query, cache, md = _fp8_batch(torch.float8_e4m3fn, (1.0, 1.0), group=9, head_dim=32)
    assert paged_attention_cpu(query, cache, md, 0.2) is None  # groups over 8
    query, cache, md = _fp8_batch(torch.float8_e4m3fn, (1.0, 1.0))
    assert paged_attention_cpu(query.float(), cache, md, 0.2) is None  # float32 activations


@needs_bf16
@pytest.mark.parametrize("fp8", FP8)
def test_rope_attention_over_fp8_gives_the_three_kernels_bits(fp8) -> None:
    qkv, positions, table, bf16_cache, md, num_heads = _qkv_batch(3, 64)
    kv_scale = SCALES[2]
    cache = torch.stack([quantize_kv(bf16_cache[:, i], fp8, kv_scale[i]) for i in (0, 1)], dim=1)
    check_rope_attention(qkv, positions, table, cache, md, num_heads, 64, kv_scale)
