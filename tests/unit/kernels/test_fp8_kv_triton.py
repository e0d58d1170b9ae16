"""An fp8 KV cache in the Triton kernels (without a GPU, in Triton's interpreter): the write stores
the torch reference's bytes, and attention over fp8 codes matches the reference over the same
codes.

The interpreter has the fp8 types and widens every finite code exactly, but its float32 -> fp8
cast neither rounds ties to even nor carries a rounded-up mantissa into the exponent: the
write's own integer conversion (kernels/triton/fp8.py), which every GPU target runs too, is what
these tests hold to the reference's bytes."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.attention import AttentionMetadata, paged_attention_torch
from pdserve.kernels.kv_cache import (
    FP8_MAX,
    KVScale,
    quantize_kv,
    write_kv_cache_torch,
    write_kv_cache_triton,
)
from pdserve.kernels.triton.attention import paged_attention_triton
from pdserve.kernels.triton.launch_configs import check_fp8_cache_on_cuda
from tests.unit.kernels.test_attention import DEVICE, MIXED, TOLERANCE, _batch

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Powers of two: the ties between codes stay ties once scaled.
SCALES = [(0.5, 2.0), (1.0, 1.0)]


@pytest.fixture(params=FP8, ids=["e4m3", "e5m2"])
def fp8(request: pytest.FixtureRequest) -> torch.dtype:
    if DEVICE.type == "cuda":
        try:
            check_fp8_cache_on_cuda(request.param, torch.cuda.get_device_capability())
        except ValueError as e:
            pytest.skip(str(e))
    return request.param


def _every_rounding(fp8: torch.dtype) -> torch.Tensor:
    """Every finite code of the format, each tie between two neighbours and the floats just
    either side of it, values past the largest code, and float32 subnormals; both signs."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    codes = codes[codes.isfinite()].unique()
    ties = (codes[1:] + codes[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    beyond = [FP8_MAX[fp8] * 1.07, 1e30, float("inf"), 1e-40, 2.0**-149]
    values = torch.cat(
        [codes, ties, ties.nextafter(up), ties.nextafter(down), torch.tensor(beyond)]
    )
    return torch.cat([values, -values])


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_scale", SCALES)
def test_triton_write_stores_the_reference_bytes(
    fp8: torch.dtype, kv_scale: KVScale, act: torch.dtype
) -> None:
    heads, dim, block_size = 2, 32, 16
    values = _every_rounding(fp8)
    tokens = -(-values.numel() // (heads * dim))
    key = torch.zeros(tokens * heads * dim)
    key[: values.numel()] = values
    key = key.view(tokens, heads, dim).to(act)
    value = key.flip(0)
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(8 * block_size, generator=gen)[:tokens]
    slots[3] = -1  # a padding token: not written
    # A layer's view of a two-layer engine cache: not contiguous.
    cache = torch.zeros(8, 2, 2, block_size, heads, dim, dtype=fp8, device=DEVICE)
    expected = cache.clone()
    key, value, slots = key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE)
    write_kv_cache_triton(key, value, cache[:, 1], slots, kv_scale)
    write_kv_cache_torch(key, value, expected[:, 1], slots, kv_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache[:, 1].float().abs().max() == FP8_MAX[fp8]  # saturated, not a NaN


def _fp8_batch(
    fp8: torch.dtype, kv_scale: KVScale, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """_batch's query and metadata, and its cache's keys and values (garbage in the slots no
    request owns included) as fp8 codes."""
    query, cache, md = _batch(MIXED + [(1, 150)], dtype=dtype, head_dim=32)
    codes = torch.stack([quantize_kv(cache[:, i], fp8, kv_scale[i]) for i in (0, 1)], dim=1)
    return query, codes, md


@pytest.mark.parametrize("kv_scale", SCALES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_over_fp8_matches_the_reference(
    fp8: torch.dtype, kv_scale: KVScale, num_splits: int
) -> None:
    query, codes, md = _fp8_batch(fp8, kv_scale, torch.float32)
    scale = 32**-0.5
    out = paged_attention_triton(query, codes, md, scale, num_splits, kv_scale=kv_scale)
    expected = paged_attention_torch(query, codes, md, scale, kv_scale=kv_scale)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_triton_attention_over_fp8_in_bf16_with_window_and_softcap(fp8: torch.dtype) -> None:
    """16-bit queries (the dot's dtype on a GPU) and the scores' window and cap, which k_scale
    must precede."""
    kv_scale = SCALES[0]
    query, codes, md = _fp8_batch(fp8, kv_scale, torch.bfloat16)
    query = query * 3  # scores past the cap
    scale = 32**-0.5
    out = paged_attention_triton(query, codes, md, scale, window=10, softcap=1.5, kv_scale=kv_scale)
    expected = paged_attention_torch(query.float(), codes, md, scale, 10, 1.5, kv_scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[torch.bfloat16])


def test_batch_invariant_splits_give_the_same_bits_over_fp8(fp8: torch.dtype) -> None:
    """v_scale applies to each split's state: its splits run in one program or in a program
    each (folded by the combine kernel), a query's bits are the same."""
    kv_scale = (0.5, 1.7)  # not a power of two: scaling before or after a fold rounds apart
    query, cache, md = _batch([(1, 600), (1, 30)], num_kv_heads=1, head_dim=16)
    codes = torch.stack([quantize_kv(cache[:, i], fp8, kv_scale[i]) for i in (0, 1)], dim=1)
    scale = 16**-0.5
    one, each = (
        paged_attention_triton(query, codes, md, scale, n, batch_invariant=True, kv_scale=kv_scale)
        for n in (1, 2)
    )
    assert torch.equal(one, each)
    expected = paged_attention_torch(query, codes, md, scale, kv_scale=kv_scale)
    torch.testing.assert_close(one, expected, **TOLERANCE[torch.float32])
