"""KV cache blocks: reference counts, the free queue (LRU eviction) and the prefix-cache index."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from pdserve.distributed.kv_events import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_block_hash,
)

logger = logging.getLogger(__name__)


class KVCacheBlock:
    """One block of the paged KV cache, as the scheduler sees it (the tensors live in workers)."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is full and indexed in the prefix cache; kept after the block is
        # freed (lazy eviction) so that a later request can still hit it.
        self.block_hash: bytes | None = None
        # Links of the free queue; None while the block is in use.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={hashed})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: least recently freed at the head (evicted first).

    A list would make removing a prefix-cache hit from the middle O(n); the links in the
    blocks make popleft, append and remove all O(1). Two sentinels spare the edge cases.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self.fake_head.next_free_block
        assert block is not None and block is not self.fake_tail, "no free blocks"
        self.remove(block)
        return block

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """The `num_blocks` least recently freed blocks, unlinked in one pass."""
        assert num_blocks <= self.num_free_blocks, "not enough free blocks"
        head = self.fake_head
        blocks = []
        block = head.next_free_block
        for _ in range(num_blocks):
            assert block is not None
            blocks.append(block)
            next_block = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = next_block
        assert block is not None
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= num_blocks
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is None and block.next_free_block is None
        last = self.fake_tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1


class BlockPool:
    """All KV cache blocks of one instance; block 0 is the null block and is never handed out."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        block_size: int = 16,
        enable_kv_cache_events: bool = False,
    ) -> None:
        assert num_blocks >= 2, "one block is the null block; at least one more is needed"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Padding entries of block tables point at the null block; it holds no request's KV.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # One block per hash: a block recomputed under a hash that is already cached stays
        # uncached (see cache_full_blocks), so the index never needs more than one entry.
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # What entered and left the prefix cache since the last take_events(); None: not kept.
        self.events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        block_hashes: list[bytes],
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] = (),
    ) -> None:
        """Index blocks[num_cached_blocks:num_full_blocks], which have just become full;
        `token_ids` (the request's) only feed the block-stored events."""
        assert len(block_hashes) >= num_full_blocks
        index = self.cached_block_hash_to_block
        # Which blocks joined the index, kept only for the events.
        stored: list[int] | None = [] if self.events is not None else None
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block_hash = block_hashes[i]
            if block_hash in index:
                # Same tokens computed twice (e.g. the last block of a full prefix hit, which
                # is always recomputed): the older block stays the one that later requests hit.
                continue
            block.block_hash = block_hash
            index[block_hash] = block
            if stored is not None:
                stored.append(i)
        if stored:
            self._stored_events(block_hashes, stored, token_ids)

    def _stored_events(
        self, block_hashes: list[bytes], stored: list[int], token_ids: Sequence[int]
    ) -> None:
        """One BlockStored per unbroken run of newly indexed blocks: a duplicate skipped in the
        middle was already announced, and a run names its own parent."""
        size = self.block_size
        run_start = 0
        for j in range(1, len(stored) + 1):
            if j < len(stored) and stored[j] == stored[j - 1] + 1:
                continue
            first, last = stored[run_start], stored[j - 1]
            self.events.append(  # type: ignore[union-attr]
                BlockStored(
                    block_hashes=[external_block_hash(h) for h in block_hashes[first : last + 1]],
                    parent_block_hash=(
                        external_block_hash(block_hashes[first - 1]) if first else None
                    ),
                    token_ids=list(token_ids[first * size : (last + 1) * size]),
                    block_size=size,
                    lora_id=None,
                    medium=MEDIUM,
                    lora_name=None,
                )
            )
            run_start = j

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self.evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return blocks

    def evict_cached_block(self, block: KVCacheBlock) -> None:
        """Drop the block from the prefix cache; its contents stay until it is reused."""
        assert block.block_hash is not None
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.events is not None:
                self.events.append(
                    BlockRemoved(
                        block_hashes=[external_block_hash(block.block_hash)], medium=MEDIUM
                    )
                )
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block takes it off the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the tail of the free queue.

        The caller orders them: the first freed is the first evicted.
        """
        append = self.free_block_queue.append
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0 and not block.is_null:
                append(block)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        num_usable = self.num_blocks - 1
        return 1.0 - self.free_block_queue.num_free_blocks / num_usable

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        num_used = self.num_blocks - 1 - self.free_block_queue.num_free_blocks
        if num_used > 0:
            logger.warning("Cannot reset the prefix cache: %d blocks are still in use.", num_used)
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        logger.info("Prefix cache reset.")
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call ([] when events are off)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events
