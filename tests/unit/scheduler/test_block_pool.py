"""Block pool: the null block, reference counts, the free queue and LRU eviction."""

from __future__ import annotations

import pytest

from pdserve.scheduler.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pdserve.scheduler.kv_cache_utils import hash_block_tokens
from tests.unit.scheduler.conftest import free_blocks


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in free_blocks(pool.free_block_queue)]


def make_pool(
    pools: list[BlockPool], num_blocks: int = 8, enable_caching: bool = True
) -> BlockPool:
    pool = BlockPool(num_blocks, enable_caching)
    pools.append(pool)
    return pool


def test_null_block_is_never_handed_out(pools: list[BlockPool]) -> None:
    pool = make_pool(pools, num_blocks=4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 1.0
    with pytest.raises(AssertionError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0


def test_free_queue_remove_from_middle_and_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in free_blocks(queue)] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in free_blocks(queue)] == [1, 3, 4, 2, 0]
    assert queue.num_free_blocks == 5
    # A block in use carries no links; removing it again is an error.
    queue.remove(blocks[4])
    assert blocks[4].prev_free_block is None and blocks[4].next_free_block is None
    with pytest.raises(AssertionError):
        queue.remove(blocks[4])
    for _ in range(4):
        queue.popleft()
    assert queue.num_free_blocks == 0
    with pytest.raises(AssertionError):
        queue.popleft()


def test_ref_counts_shared_blocks(pools: list[BlockPool]) -> None:
    pool = make_pool(pools)
    (block,) = pool.get_new_blocks(1)
    assert block.ref_cnt == 1
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in free_ids(pool)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool)[-1] == block.block_id
    with pytest.raises(AssertionError):
        pool.free_blocks([block])
    block.ref_cnt = 0  # undo the failed double free for the teardown check


def test_freed_blocks_go_to_tail_in_caller_order(pools: list[BlockPool]) -> None:
    pool = make_pool(pools, num_blocks=6)
    a, b, c = pool.get_new_blocks(3)
    assert free_ids(pool) == [4, 5]
    pool.free_blocks([c, b, a])
    assert free_ids(pool) == [4, 5, 3, 2, 1]


def test_cached_blocks_are_evicted_least_recently_freed_first(pools: list[BlockPool]) -> None:
    pool = make_pool(pools, num_blocks=5)
    blocks = pool.get_new_blocks(4)
    hashes, parent = [], None
    for i in range(4):
        parent = hash_block_tokens(parent, [i])
        hashes.append(parent)
    pool.cache_full_blocks(hashes, blocks, 0, 4)
    assert all(pool.get_cached_block(h) is b for h, b in zip(hashes, blocks, strict=True))
    # Freed blocks keep their hashes (lazy eviction) ...
    pool.free_blocks([blocks[1], blocks[3], blocks[0], blocks[2]])
    assert all(pool.get_cached_block(h) is not None for h in hashes)
    # ... until they are handed out again, oldest free first.
    (new,) = pool.get_new_blocks(1)
    assert new is blocks[1] and new.block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    # A hit on a free cached block takes it out of the queue, so it is not evicted next.
    pool.touch([blocks[3]])
    assert pool.get_new_blocks(1) == [blocks[0]]
    assert pool.get_cached_block(hashes[3]) is blocks[3] and blocks[3].ref_cnt == 1
    pool.free_blocks([new, blocks[3], blocks[0]])


def test_duplicate_hash_keeps_the_first_block(pools: list[BlockPool]) -> None:
    pool = make_pool(pools)
    first, second = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([block_hash], [first], 0, 1)
    pool.cache_full_blocks([block_hash], [second], 0, 1)
    assert pool.get_cached_block(block_hash) is first and second.block_hash is None
    pool.free_blocks([second, first])


def test_reset_prefix_cache(pools: list[BlockPool]) -> None:
    pool = make_pool(pools)
    (block,) = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [1])
    pool.cache_full_blocks([block_hash], [block], 0, 1)
    assert not pool.reset_prefix_cache()  # refused while a block is in use
    pool.free_blocks([block])
    assert pool.get_cached_block(block_hash) is block
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(block_hash) is None and block.block_hash is None


def test_hashes_are_chained_and_stable() -> None:
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, (1, 2, 3)) and len(h1) == 32
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(hash_block_tokens(None, [9]), [4])
