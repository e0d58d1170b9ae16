"""The C++ CPU paged attention (csrc/paged_attention_cpu.cpp) against the torch reference, and
its fallback where no compiler builds it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pdserve.kernels import attention, native
from pdserve.kernels.attention import paged_attention, paged_attention_cpu, paged_attention_torch
from tests.unit.kernels.test_attention import MIXED, TOLERANCE, _batch

pytestmark = pytest.mark.skipif(
    native.load("paged_attention_cpu") is None, reason="no C++ compiler on this machine"
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


def test_long_queries_use_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(attention, "paged_attention_torch", lambda *args: calls.append("torch"))
    query, kv_cache, md = _batch([(attention._CPU_KERNEL_MAX_QUERY_LEN + 1, 3)])
    paged_attention(query, kv_cache, md, 1.0)
    assert calls == ["torch"]


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
        with caplog.at_level(logging.WARNING, logger="pdserve.kernels.native"):
            first = paged_attention(query, kv_cache, md, 0.5)
            paged_attention(query, kv_cache, md, 0.5)
        torch.testing.assert_close(first, paged_attention_torch(query, kv_cache, md, 0.5))
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "no-such-compiler" in warnings[0].getMessage()
    finally:
        native.load.cache_clear()
        attention._cpu_kernel.cache_clear()
