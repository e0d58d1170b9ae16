"""The Triton and the CPU KV cache writes against their torch reference, on a layer view of the
engine's block-major cache, with keys and values sliced out of one projection as the models do."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import kv_cache
from pdserve.kernels.kv_cache import (
    write_kv_cache,
    write_kv_cache_cpu,
    write_kv_cache_torch,
    write_kv_cache_triton,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_BLOCKS, NUM_LAYERS, LAYER = 6, 3, 1
CPU_CASES = [
    (2, 16, 4, torch.float32),
    (1, 32, 16, torch.float16),
    (3, 24, 16, torch.bfloat16),  # heads and head_dim not powers of two
]


def _inputs(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_blocks: int = NUM_BLOCKS,
    device: torch.device = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key, value, engine cache): key/value are non-contiguous column slices of one qkv tensor."""
    gen = torch.Generator().manual_seed(0)
    kv_size = num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, 3 * kv_size, generator=gen).to(dtype)
    _, key, value = qkv.split([kv_size, kv_size, kv_size], dim=-1)
    shape = (num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)
    return (
        key.unflatten(-1, (num_kv_heads, head_dim)).to(device),
        value.unflatten(-1, (num_kv_heads, head_dim)).to(device),
        cache.to(device),
    )


def _slots(
    num_slots: int,
    block_size: int,
    padding: list[int],
    num_blocks: int = NUM_BLOCKS,
    device: torch.device = DEVICE,
) -> torch.Tensor:
    """Distinct slots spread over shuffled blocks, -1 at the padding positions."""
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_slots]
    slots[padding] = -1
    return slots.to(device)


@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size", "dtype"), CPU_CASES)
def test_triton_write_matches_torch(
    num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    # 13 rows of key/value, 11 slots: the last two rows are batch padding, never written.
    key, value, cache = _inputs(13, num_kv_heads, head_dim, block_size, dtype)
    slot_mapping = _slots(11, block_size, padding=[0, 5, 10])
    expected = cache.clone()
    write_kv_cache_torch(key, value, expected[:, LAYER], slot_mapping)
    write_kv_cache_triton(key, value, cache[:, LAYER], slot_mapping)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_triton_write_converts_to_cache_dtype() -> None:
    # fp16, not bf16: the interpreter rounds fp32 -> bf16 toward zero, torch to nearest.
    key, value, cache = _inputs(5, 2, 16, 4, torch.float32)
    cache = cache.to(torch.float16)
    slot_mapping = _slots(5, 4, padding=[])
    expected = cache.clone()
    write_kv_cache_torch(key, value, expected[:, LAYER], slot_mapping)
    write_kv_cache_triton(key, value, cache[:, LAYER], slot_mapping)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_empty_batch_writes_nothing() -> None:
    key, value, cache = _inputs(0, 2, 16, 4, torch.float32)
    expected = cache.clone()
    write_kv_cache_triton(key, value, cache[:, LAYER], _slots(0, 4, padding=[]))
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dispatch_follows_forced_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(kv_cache, "write_kv_cache_triton", lambda *args: calls.append("triton"))
    monkeypatch.setattr(kv_cache, "write_kv_cache_torch", lambda *args: calls.append("torch"))
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", backend)
    key, value, cache = _inputs(1, 1, 16, 4, torch.float32)
    write_kv_cache(key, value, cache[:, LAYER], _slots(1, 4, padding=[]))
    assert calls == [backend]


CPU = torch.device("cpu")


@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size", "dtype"), CPU_CASES)
def test_cpu_write_matches_torch(
    num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    key, value, cache = _inputs(13, num_kv_heads, head_dim, block_size, dtype, device=CPU)
    slot_mapping = _slots(11, block_size, padding=[0, 5, 10], device=CPU)
    expected = cache.clone()
    write_kv_cache_torch(key, value, expected[:, LAYER], slot_mapping)
    assert write_kv_cache_cpu(key, value, cache[:, LAYER], slot_mapping)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_cpu_write_of_a_prefill_splits_over_threads() -> None:
    # 3000 tokens x 2 heads: past the size where the kernel runs its OpenMP loop.
    key, value, cache = _inputs(3000, 2, 16, 16, torch.bfloat16, num_blocks=200, device=CPU)
    slot_mapping = _slots(3000, 16, padding=[7], num_blocks=200, device=CPU)
    expected = cache.clone()
    write_kv_cache_torch(key, value, expected[:, LAYER], slot_mapping)
    assert write_kv_cache_cpu(key, value, cache[:, LAYER], slot_mapping)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_cpu_write_leaves_conversions_to_the_reference() -> None:
    key, value, cache = _inputs(5, 2, 16, 4, torch.float32, device=CPU)
    cache = cache.to(torch.bfloat16)
    before = cache.clone()
    assert not write_kv_cache_cpu(key, value, cache[:, LAYER], _slots(5, 4, [], device=CPU))
    torch.testing.assert_close(cache, before, rtol=0, atol=0)
    write_kv_cache(key, value, cache[:, LAYER], _slots(5, 4, [], device=CPU))  # the reference
    expected = before.clone()
    write_kv_cache_torch(key, value, expected[:, LAYER], _slots(5, 4, [], device=CPU))
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
