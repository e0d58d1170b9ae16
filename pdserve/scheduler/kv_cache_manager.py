"""Per-request block tables over the block pool, with prefix caching."""

from __future__ import annotations

from pdserve.request import Request
from pdserve.scheduler.block_pool import BlockPool, KVCacheBlock
from pdserve.scheduler.kv_cache_utils import request_block_hasher
from pdserve.utils import cdiv


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """`num_lookahead_tokens`: slots every request holds past its scheduled tokens (a
        draft model writes its guesses' KV there)."""
        self.block_size = block_size
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, block_size, enable_kv_cache_events)
        self.block_hasher = request_block_hasher(block_size)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix cache (or were
        # skipped as duplicates), so that caching resumes where it stopped.
        self.num_cached_block: dict[str, int] = {}
        # Cumulative prefix-cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request, and its token count.

        No hits for a request that asks for prompt logprobs: every prompt position must be
        computed for them (its own blocks are still cached for others, as vLLM's).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.block_hasher(request)
        # The last token is always recomputed, for its logits; that can cost a whole block.
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        num_computed_tokens = len(computed_blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed_tokens
        return computed_blocks, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        reserved_blocks: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request blocks for `num_new_tokens` more tokens; None if the pool is short.

        `new_computed_blocks` (prefix-cache hits of `num_new_computed_tokens` tokens) and
        `num_external_computed_tokens` (tokens a KV connector loads) only come with a request
        that holds no blocks yet. Returns the newly allocated blocks (not the hits).
        """
        assert num_new_tokens > 0 or num_external_computed_tokens > 0
        req_id = request.request_id
        block_size = self.block_size
        num_tokens = request.num_computed_tokens + num_new_tokens
        if num_new_computed_tokens or num_external_computed_tokens:
            num_tokens += num_new_computed_tokens + num_external_computed_tokens
        num_slots = min(num_tokens + self.num_lookahead_tokens, self.max_model_len)
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is None:
            new_blocks = self._allocate_first_blocks(
                req_id, num_slots, new_computed_blocks, reserved_blocks
            )
            if new_blocks is None:
                return None
            req_blocks = self.req_to_blocks[req_id]
        else:
            assert not new_computed_blocks, "prefix hits come only with a request's first blocks"
            # A decode whose last block still has room needs nothing.
            new_blocks = []
            num_blocks_to_allocate = cdiv(num_slots, block_size) - len(req_blocks)
            if num_blocks_to_allocate > 0:
                num_free_blocks = self.block_pool.free_block_queue.num_free_blocks
                if num_blocks_to_allocate > num_free_blocks - reserved_blocks:
                    return None
                new_blocks = self.block_pool.get_new_blocks(num_blocks_to_allocate)
                req_blocks += new_blocks
        # The first token count that needs a slot the request lacks (its lookahead included),
        # or (below) fills a block not cached yet: until then the scheduler need not call here.
        boundary = len(req_blocks) * block_size + 1 - self.num_lookahead_tokens
        if self.enable_caching:
            num_cached_blocks = self.num_cached_block.get(req_id, 0)
            # Blocks are cached once scheduled, before the forward fills them: a request that
            # hits them in the same step reads them after this step's KV writes. Only known
            # tokens are hashed: not lookahead slots, nor (async scheduling) the tokens that
            # steps in flight sample; update_from_output caches those blocks once they are known.
            num_known_tokens = request.num_tokens
            if num_tokens < num_known_tokens:
                num_known_tokens = num_tokens
            num_full_blocks = num_known_tokens // block_size
            if num_full_blocks > num_cached_blocks and not delay_cache_blocks:
                self.block_hasher(request)
                self.block_pool.cache_full_blocks(
                    request.block_hashes,
                    req_blocks,
                    num_cached_blocks,
                    num_full_blocks,
                    request.all_token_ids,
                )
                self.num_cached_block[req_id] = num_cached_blocks = num_full_blocks
            next_full_block = (num_cached_blocks + 1) * block_size
            if next_full_block < boundary:
                boundary = next_full_block
        request.next_kv_boundary = boundary
        return new_blocks

    def _allocate_first_blocks(
        self,
        req_id: str,
        num_slots: int,
        new_computed_blocks: list[KVCacheBlock] | None,
        reserved_blocks: int,
    ) -> list[KVCacheBlock] | None:
        """The block table of a request that holds none: prefix hits first, then new blocks."""
        num_blocks_to_allocate = cdiv(num_slots, self.block_size)
        num_evictable_hits = 0
        if new_computed_blocks:
            assert self.enable_caching
            num_blocks_to_allocate -= len(new_computed_blocks)
            # Hits on free blocks leave the free queue when touched: they count too.
            num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        num_free_blocks = self.block_pool.get_num_free_blocks() - reserved_blocks
        if num_blocks_to_allocate + num_evictable_hits > num_free_blocks:
            return None
        # Created only now, so that a failed admission leaves no entry behind.
        req_blocks = self.req_to_blocks[req_id] = []
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks += new_computed_blocks
            self.num_cached_block[req_id] = len(new_computed_blocks)
        if num_blocks_to_allocate <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_blocks_to_allocate)
        req_blocks += new_blocks
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's blocks that the first `num_computed_tokens` tokens fill."""
        assert self.enable_caching
        block_size = self.block_size
        num_full_blocks = num_computed_tokens // block_size
        req_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(req_id, 0)
        if num_full_blocks <= num_cached_blocks:
            return
        req_blocks = self.req_to_blocks[req_id]
        self.block_hasher(request)
        self.block_pool.cache_full_blocks(
            request.block_hashes,
            req_blocks,
            num_cached_blocks,
            num_full_blocks,
            request.all_token_ids,
        )
        self.num_cached_block[req_id] = num_full_blocks
        request.next_kv_boundary = min(
            len(req_blocks) * block_size + 1 - self.num_lookahead_tokens,
            (num_full_blocks + 1) * block_size,
        )

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its last blocks are evicted first.

        Blocks are cached when scheduled. Those past `num_computed_tokens` belong to a step
        that will not run (the request was preempted in the step that scheduled it): their
        KV is incomplete, so they leave the prefix cache.
        """
        request.next_kv_boundary = 0
        blocks = self.req_to_blocks.pop(request.request_id, None)
        num_cached_blocks = self.num_cached_block.pop(request.request_id, 0)
        if not blocks:
            return
        for block in blocks[request.num_computed_tokens // self.block_size : num_cached_blocks]:
            if block.block_hash is not None:
                self.block_pool.evict_cached_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
