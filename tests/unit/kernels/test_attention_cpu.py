"""The C++ CPU paged attention (csrc/paged_attention_cpu.cpp) against the torch reference, its
fused rotary + cache write + attention call against the three kernels, and the fallback where
no compiler builds it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pdserve.kernels import attention
from pdserve.kernels.attention import (
    paged_attention,
    paged_attention_cpu,
    paged_attention_torch,
    rope_attention_cpu,
)
from pdserve.kernels.cpu import native
from pdserve.kernels.kv_cache import UNIT_SCALE, write_kv_cache
from pdserve.kernels.rotary import rotary_embedding
from pdserve.models.layers.rotary_embedding import get_rope
from tests.unit.kernels.test_attention import MIXED, TOLERANCE, WINDOWED, _batch, _select

pytestmark = pytest.mark.skipif(
    not native.compiler_available(), reason="no C++ compiler on this machine"
)


def _check(query: torch.Tensor, kv_cache: torch.Tensor, md: attention.AttentionMetadata) -> None:
    scale = query.shape[-1] ** -0.5
    out = paged_attention_cpu(query, kv_cache, md, scale)
    assert out is not None
    expected = paged_attention_torch(query.float(), kv_cache.float(), md, scale)
    assert out.dtype == query.dtype and out.shape == (md.num_actual_tokens, *query.shape[1:])
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[query.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_mixed_batch_matches_reference(dtype: torch.dtype, group: int, head_dim: int) -> None:
    # Padding rows past the last request's tokens stay out of the output.
    _check(*_batch(MIXED, group=group, head_dim=head_dim, dtype=dtype, num_padding_tokens=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(10, 0.0), (0, 1.5), (37, 1.5)])
def test_window_and_softcap_match_reference(
    dtype: torch.dtype, window: int, softcap: float
) -> None:
    """Both the vector paths (bf16 16 keys at a time, head 32) and the scalar ones (head 24),
    each query's result the same alone as in its batch."""
    for head_dim in (32, 24):
        query, kv_cache, md = _batch(WINDOWED, head_dim=head_dim, dtype=dtype, block_size=4)
        query = query * 3  # scores past the cap
        scale = head_dim**-0.5
        out = paged_attention_cpu(query, kv_cache, md, scale, window, softcap)
        assert out is not None
        expected = paged_attention_torch(
            query.float(), kv_cache.float(), md, scale, window, softcap
        )
        torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
        last = len(WINDOWED) - 1
        alone_query, alone = _select(query, md, [last])
        alone_out = paged_attention_cpu(alone_query, kv_cache, alone, scale, window, softcap)
        assert torch.equal(alone_out, out[int(md.query_start_loc[last]) :])


def test_shapes_off_the_vector_path() -> None:
    # Head size not a multiple of 16 and groups over 8 take the kernel's scalar loops.
    _check(*_batch(MIXED, group=10, head_dim=24))
    _check(*_batch(MIXED, group=9, head_dim=64, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_decodes_over_many_blocks(block_size: int, dtype: torch.dtype) -> None:
    # bf16 scores 16 keys at a time: blocks of 4 give partial groups, blocks of 32 two groups.
    requests = [(1, 150), (1, 0), (1, 31), (1, 32), (1, 33)]
    _check(*_batch(requests, block_size=block_size, dtype=dtype, group=3))


def test_strided_query() -> None:
    # q as the model hands it over: a slice of the fused qkv projection, rows far apart.
    query, kv_cache, md = _batch(MIXED, group=2)
    fused = torch.cat([query, torch.full_like(query, 1e4)], dim=1)
    _check(fused[:, : query.shape[1]], kv_cache, md)


def test_long_queries_run_the_kernel() -> None:
    # No query length hands the batch to SDPA: its padded tiles would make a decode's bits
    # depend on the prompts beside it.
    _check(*_batch([(150, 3), (1, 40), (70, 0)], group=3, dtype=torch.bfloat16))


def test_forced_torch_backend_skips_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "torch")
    monkeypatch.setattr(attention, "paged_attention_cpu", lambda *args: pytest.fail("kernel ran"))
    query, kv_cache, md = _batch([(1, 3)])
    paged_attention(query, kv_cache, md, 1.0)


def test_library_is_built_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    first = native._build("paged_attention_cpu")
    mtime = first.stat().st_mtime_ns
    assert native._build("paged_attention_cpu") == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]


def test_no_compiler_falls_back_to_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    native.load.cache_clear()
    attention._cpu_kernel.cache_clear()
    try:
        query, kv_cache, md = _batch(MIXED)
        with caplog.at_level(logging.WARNING, logger="pdserve.kernels.cpu.native"):
            first = paged_attention(query, kv_cache, md, 0.5)
            paged_attention(query, kv_cache, md, 0.5)
        torch.testing.assert_close(first, paged_attention_torch(query, kv_cache, md, 0.5))
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "no-such-compiler" in warnings[0].getMessage()
    finally:
        native.load.cache_clear()
        attention._cpu_kernel.cache_clear()


def _qkv_batch(group: int, head_dim: int, requests=MIXED):
    """A layer's q/k/v projection for `requests` (query length, context length), their positions,
    a cache holding their contexts and a bf16 rotary table."""
    _, kv_cache, md = _batch(requests, group=group, head_dim=head_dim, dtype=torch.bfloat16)
    num_kv_heads = kv_cache.shape[3]
    num_heads = num_kv_heads * group
    gen = torch.Generator().manual_seed(group * head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(md.num_actual_tokens, width, generator=gen).bfloat16()
    positions = torch.cat([torch.arange(context, context + q) for q, context in requests]).to(
        torch.int64
    )
    table = get_rope(head_dim, {"rope_theta": 10000.0}, 256, torch.bfloat16).cos_sin_cache
    return qkv, positions, table, kv_cache, md, num_heads


@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (1, 32), (9, 64), (2, 24)])
def test_rope_attention_gives_the_three_kernels_bits(group: int, head_dim: int) -> None:
    """Rotary + cache write + attention in one call: the output and the cache are bit for bit
    what the three kernels give (groups over 8 and odd head sizes take the scalar paths)."""
    qkv, positions, table, kv_cache, md, num_heads = _qkv_batch(group, head_dim)
    check_rope_attention(qkv, positions, table, kv_cache, md, num_heads, head_dim)


def check_rope_attention(
    qkv, positions, table, kv_cache, md, num_heads: int, head_dim: int, kv_scale=UNIT_SCALE
) -> None:
    """The fused call's output and the cache it leaves against rotary, the cache write and
    attention run one by one: bit for bit."""
    num_kv_heads, scale = kv_cache.shape[3], head_dim**-0.5
    fused_cache, steps_cache = kv_cache.clone(), kv_cache.clone()
    out = rope_attention_cpu(
        qkv, positions, table, fused_cache, md, num_heads, head_dim, scale, kv_scale=kv_scale
    )
    assert out is not None and out.shape == (md.num_actual_tokens, num_heads * head_dim)
    q, k, v = qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=-1)
    q, k = rotary_embedding(
        positions,
        q.unflatten(-1, (num_heads, head_dim)),
        k.unflatten(-1, (num_kv_heads, head_dim)),
        table,
    )
    v = v.unflatten(-1, (num_kv_heads, head_dim))
    write_kv_cache(k, v, steps_cache, md.slot_mapping, kv_scale)
    expected = paged_attention(q, steps_cache, md, scale, kv_scale=kv_scale)
    assert torch.equal(fused_cache.view(torch.uint8), steps_cache.view(torch.uint8))
    assert torch.equal(out, expected.flatten(1))


def test_rope_attention_applies_to_unpadded_bf16_batches_only() -> None:
    qkv, positions, table, kv_cache, md, num_heads = _qkv_batch(2, 64)
    args = (kv_cache, md, num_heads, 64, 0.125)
    assert rope_attention_cpu(qkv.float(), positions, table, *args) is None  # fp32: HF's rotary
    assert rope_attention_cpu(qkv, positions, table.float(), *args) is None
    padded = torch.cat([qkv, qkv[:1]])  # a padded batch: the caller pads the output
    assert rope_attention_cpu(padded, positions, table, *args) is None
    long = _qkv_batch(2, 64, requests=[(65, 0)])
    assert rope_attention_cpu(*long[:5], long[5], 64, 0.125) is not None  # any query length
