"""The Triton paged attention against the torch reference (run in fp32 on the same inputs).

Requests' blocks are shuffled, so block ids are neither contiguous nor ascending, and every
slot no request owns holds large garbage, so that attending to one shows in the output.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import attention
from pdserve.kernels.attention import AttentionMetadata, paged_attention, paged_attention_torch
from pdserve.kernels.kv_cache import write_kv_cache_torch
from pdserve.kernels.triton.attention import num_splits_heuristic, paged_attention_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GARBAGE = 1e4
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
# (query_len, context_len) per request: a decode, a chunk after context, a decode whose
# sequence ends on a block boundary, a fresh prefill with a partial last block.
MIXED = [(1, 20), (7, 9), (1, 63), (13, 0)]


def _batch(
    reqs: list[tuple[int, int]],
    *,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_padding_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(query, layer 1 of a two-layer engine cache, metadata) for requests (query_len, context)."""
    gen = torch.Generator().manual_seed(0)
    query_lens = [q for q, _ in reqs]
    seq_lens = [q + c for q, c in reqs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    block_ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is null
    block_table = torch.zeros(len(reqs), max(blocks_per_req, default=1), dtype=torch.int32)
    kv_slots: list[int] = []
    query_slots: list[int] = []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        table = [block_ids.pop() for _ in range(blocks_per_req[i])]
        block_table[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        kv_slots += slots
        query_slots += slots[seq_len - query_len :]
    shape = (num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, GARBAGE, dtype=dtype)
    key, value = torch.randn(2, len(kv_slots), num_kv_heads, head_dim, generator=gen)
    write_kv_cache_torch(key, value, cache[:, 1], torch.tensor(kv_slots, dtype=torch.int64))
    num_tokens = sum(query_lens)
    query = torch.randn(
        num_tokens + num_padding_tokens, num_kv_heads * group, head_dim, generator=gen
    ).to(dtype)
    md = AttentionMetadata(
        num_reqs=len(reqs),
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(query_slots, dtype=torch.int64),
    )
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        setattr(md, name, getattr(md, name).to(DEVICE))
    return query.to(DEVICE), cache.to(DEVICE)[:, 1], md


def _check(
    query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, num_splits: int | None
) -> torch.Tensor:
    """Run the kernel, compare it with the fp32 reference; returns the kernel's output."""
    scale = query.shape[-1] ** -0.5
    out = paged_attention_triton(query, kv_cache, md, scale, num_splits=num_splits)
    expected = paged_attention_torch(query.float(), kv_cache.float(), md, scale)
    assert out.dtype == query.dtype
    assert out.shape == (md.num_actual_tokens, *query.shape[1:])
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[query.dtype])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch_matches_reference(group: int, dtype: torch.dtype) -> None:
    # Two rows of batch padding past the last request's tokens stay out of the output.
    _check(*_batch(MIXED, group=group, dtype=dtype, num_padding_tokens=2), num_splits=None)


@pytest.mark.parametrize("block_size", [4, 128])
def test_block_size_smaller_and_larger_than_a_tile(block_size: int) -> None:
    # A key tile is 64 positions: 16 blocks of 4, or half of a block of 128.
    _check(*_batch(MIXED + [(1, 150)], block_size=block_size), num_splits=None)


def test_group_padded_to_a_power_of_two() -> None:
    _check(*_batch(MIXED, num_kv_heads=2, group=3, head_dim=24), num_splits=2)


@pytest.mark.parametrize("reqs", [[(300, 0)], [(300, 50), (1, 5)]], ids=["prefill", "chunk+decode"])
def test_long_query(reqs: list[tuple[int, int]]) -> None:
    _check(*_batch(reqs, num_kv_heads=1, head_dim=16), num_splits=None)


@pytest.mark.parametrize(
    ("reqs", "num_splits"),
    [
        ([(1, 700), (1, 64), (1, 0)], 3),  # the last two have fewer tiles than splits
        ([(1, 400), (1, 129)], 8),
        # The chunk's first rows (positions 50..63) see no key of the second split (64..).
        (MIXED + [(40, 50)], 2),
    ],
)
def test_split_kv_matches_unsplit(reqs: list[tuple[int, int]], num_splits: int) -> None:
    query, kv_cache, md = _batch(reqs, head_dim=16)
    split = _check(query, kv_cache, md, num_splits=num_splits)
    unsplit = paged_attention_triton(query, kv_cache, md, query.shape[-1] ** -0.5, num_splits=1)
    torch.testing.assert_close(split, unsplit, atol=1e-6, rtol=1e-6)


# Gemma2's attention: a window shorter than most requests' context (its keys start mid-block
# and mid-tile), logits capped where the scores reach it.
WINDOWED = [(1, 20), (7, 9), (1, 63), (13, 0), (40, 50), (1, 150)]


@pytest.mark.parametrize(("window", "softcap"), [(10, 0.0), (0, 1.5), (37, 1.5)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_window_and_softcap_match_reference(window: int, softcap: float, num_splits: int) -> None:
    query, kv_cache, md = _batch(WINDOWED, head_dim=16)
    query = query * 3  # scores past the cap
    scale = 16**-0.5
    out = paged_attention_triton(
        query, kv_cache, md, scale, num_splits=num_splits, window=window, softcap=softcap
    )
    expected = paged_attention_torch(query, kv_cache, md, scale, window, softcap)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    # Neither is a no-op here.
    assert not torch.allclose(expected, paged_attention_torch(query, kv_cache, md, scale))


def _select(
    query: torch.Tensor, md: AttentionMetadata, reqs: list[int]
) -> tuple[torch.Tensor, AttentionMetadata]:
    """The batch of requests `reqs` of md, in that order, on the same cache."""
    starts = md.query_start_loc.tolist()
    rows = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in reqs]).to(DEVICE)
    lens = [starts[r + 1] - starts[r] for r in reqs]
    seq_lens = md.seq_lens[reqs]
    sub = AttentionMetadata(
        num_reqs=len(reqs),
        num_actual_tokens=sum(lens),
        max_query_len=max(lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).int().to(DEVICE),
        seq_lens=seq_lens,
        block_table=md.block_table[reqs],
        slot_mapping=md.slot_mapping[rows],
    )
    return query[rows], sub


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_decode_alone_or_beside_a_prefill(dtype: torch.dtype) -> None:
    # 0: the probe, a decode whose 600 keys make two fixed-size splits (512); 1: a chunk after
    # 520 tokens (two splits); 2: a fresh prompt; 3, 4: decodes, the longer with three splits.
    query, kv_cache, md = _batch(
        [(1, 600), (25, 520), (40, 0), (1, 30), (1, 1030)],
        num_kv_heads=1,
        dtype=dtype,
        head_dim=16,
    )
    scale = 16**-0.5
    expected = None
    # num_splits 1: the splits one after another in each query block's program; 4: a program
    # per split (as many as the longest query has), the combine kernel folding them.
    for batch, num_splits in [
        ([0], 1),
        ([0], 4),
        ([3, 0], 1),
        ([2, 0], 4),
        ([3, 1, 0, 4], 1),
        ([3, 1, 0, 4], 4),
    ]:
        q, sub = _select(query, md, batch)
        out = paged_attention_triton(q, kv_cache, sub, scale, num_splits, batch_invariant=True)
        reference = paged_attention_torch(q.float(), kv_cache.float(), sub, scale)
        torch.testing.assert_close(out.float(), reference, **TOLERANCE[dtype])
        probe = out[int(sub.query_start_loc[batch.index(0)])]
        expected = probe if expected is None else expected
        assert torch.equal(probe, expected), f"batch {batch}, num_splits {num_splits}"


def test_split_kv_in_bf16() -> None:
    _check(*_batch([(1, 300), (1, 7)], group=4, dtype=torch.bfloat16), num_splits=4)


def test_empty_batch() -> None:
    query, kv_cache, md = _batch([], num_padding_tokens=3)
    out = paged_attention_triton(query, kv_cache, md, 1.0)
    assert out.shape == (0, *query.shape[1:])


def test_split_heuristic() -> None:
    # Decode, 64 requests x 8 kv heads, 4096 tokens, 132 SMs: a second split fills the SMs.
    assert num_splits_heuristic(512, 1, 4096, 1, 64, 132) == 2
    # One request: as many splits as keep each at least four 64-key tiles.
    assert num_splits_heuristic(8, 1, 4096, 1, 64, 132) == 16
    assert num_splits_heuristic(8, 1, 100_000, 1, 64, 132) == 32
    # Short contexts and prefills are not split.
    assert num_splits_heuristic(8, 1, 200, 1, 64, 132) == 1
    assert num_splits_heuristic(64, 300, 4096, 8, 64, 132) == 1


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dispatch_follows_forced_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(
        attention, "paged_attention_triton", lambda *args, **kwargs: calls.append("triton")
    )
    monkeypatch.setattr(attention, "paged_attention_torch", lambda *args: calls.append("torch"))
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", backend)
    query, kv_cache, md = _batch([(1, 3)])
    paged_attention(query, kv_cache, md, 1.0)
    assert calls == [backend]
