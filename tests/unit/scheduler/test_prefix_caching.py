"""KV cache manager: block tables, prefix-cache hits and their eviction."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.request import Request
from pdserve.scheduler.block_pool import BlockPool
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.kv_cache_utils import hash_block_tokens, request_block_hasher

from .conftest import BLOCK_SIZE, make_request


def make_manager(
    pools: list[BlockPool], num_blocks: int = 16, enable_caching: bool = True
) -> KVCacheManager:
    manager = KVCacheManager(
        num_blocks, BLOCK_SIZE, max_model_len=128, enable_caching=enable_caching
    )
    pools.append(manager.block_pool)
    return manager


def admit(manager: KVCacheManager, request: Request) -> int:
    """Prefix lookup + allocation for the whole prompt, as the scheduler admits a request."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
    )
    assert blocks is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def test_block_hasher_is_incremental() -> None:
    hasher = request_block_hasher(BLOCK_SIZE)
    request = make_request("r", prompt=list(range(10)))
    hasher(request)
    assert request.block_hashes == [
        hash_block_tokens(None, [0, 1, 2, 3]),
        hash_block_tokens(hash_block_tokens(None, [0, 1, 2, 3]), [4, 5, 6, 7]),
    ]
    request.append_output_token_ids([10, 11])
    hasher(request)
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], [8, 9, 10, 11])


def test_a_salt_enters_the_first_block_and_reaches_the_chain() -> None:
    """vLLM's cache_salt: an extra key of block 0 only; later blocks differ through their parent."""
    hasher = request_block_hasher(BLOCK_SIZE)
    salted = make_request("s", prompt=list(range(8)), cache_salt="tenant-a")
    hasher(salted)
    first = hash_block_tokens(None, [0, 1, 2, 3], ("tenant-a",))
    assert salted.block_hashes == [first, hash_block_tokens(first, [4, 5, 6, 7])]
    plain = make_request("p", prompt=list(range(8)))
    other = make_request("o", prompt=list(range(8)), cache_salt="tenant-b")
    hasher(plain)
    hasher(other)
    for a, b in ((salted, plain), (salted, other), (plain, other)):
        assert not set(a.block_hashes) & set(b.block_hashes)


def test_hashes_agree_across_processes() -> None:
    code = (
        "from pdserve.scheduler.kv_cache_utils import hash_block_tokens as h;"
        "print(h(None, [1, 2]).hex())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    ).stdout.strip()
    assert other == hash_block_tokens(None, [1, 2]).hex()


def test_full_blocks_hit_and_partial_blocks_do_not(pools: list[BlockPool]) -> None:
    manager = make_manager(pools)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt=prompt)
    assert admit(manager, a) == 0
    assert len(manager.req_to_blocks["a"]) == 3
    b = make_request("b", prompt=prompt[:8] + [99, 98, 97])
    assert admit(manager, b) == 8
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")[:2]
    assert manager.get_block_ids("b")[2] != manager.get_block_ids("a")[2]
    shared = manager.req_to_blocks["a"][0]
    assert shared.ref_cnt == 2
    assert manager.prefix_cache_queries == 21 and manager.prefix_cache_hits == 8
    manager.free(a)
    manager.free(b)


def test_two_salts_never_share_a_block_and_one_salt_hits_its_own(
    pools: list[BlockPool],
) -> None:
    manager = make_manager(pools)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    salts = {"a": "tenant-a", "b": "tenant-b", "plain": None, "again": "tenant-a"}
    requests = [make_request(r, prompt=prompt, cache_salt=salt) for r, salt in salts.items()]
    assert [admit(manager, r) for r in requests] == [0, 0, 0, 8]
    a_blocks = manager.get_block_ids("a")[:2]
    assert manager.get_block_ids("again")[:2] == a_blocks
    for request_id in ("b", "plain"):
        assert not set(manager.get_block_ids(request_id)) & set(a_blocks)
    for request in requests:
        manager.free(request)


def test_hit_is_capped_so_the_last_token_is_recomputed(pools: list[BlockPool]) -> None:
    manager = make_manager(pools)
    prompt = list(range(8))  # exactly 2 blocks
    a = make_request("a", prompt=prompt)
    admit(manager, a)
    manager.free(a)
    b = make_request("b", prompt=prompt)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    # 8 tokens are cached, but at most 7 may be a hit: the whole second block is recomputed.
    assert num_hit_tokens == 4 and len(hits) == 1
    assert manager.allocate_slots(b, 4, num_hit_tokens, hits) is not None
    assert len(manager.req_to_blocks["b"]) == 2
    manager.free(b)


def test_hits_survive_free_and_are_evicted_lru(pools: list[BlockPool]) -> None:
    manager = make_manager(pools, num_blocks=5)  # 4 usable blocks
    a = make_request("a", prompt=list(range(9)))  # 2 full blocks + 1 token: 3 blocks
    admit(manager, a)
    manager.free(a)
    assert manager.block_pool.get_num_free_blocks() == 4
    # The freed blocks keep their hashes: the same prefix hits them.
    again = make_request("again", prompt=list(range(9)))
    assert admit(manager, again) == 8
    manager.free(again)
    # A 2-block request takes the never-used block, then the oldest freed block: `again`
    # was freed in reverse, so that is its partial tail block and both full blocks survive.
    c = make_request("c", prompt=[50 + i for i in range(8)])
    admit(manager, c)
    d = make_request("d", prompt=list(range(9)))
    assert manager.get_computed_blocks(d)[1] == 8
    manager.free(c)
    # Free queue now: a's second block, a's first block, then c's blocks (tail first).
    e = make_request("e", prompt=[80 + i for i in range(4)])
    admit(manager, e)
    assert manager.get_computed_blocks(d)[1] == 4
    f = make_request("f", prompt=[90 + i for i in range(4)])
    admit(manager, f)
    assert manager.get_computed_blocks(d)[1] == 0
    assert manager.get_computed_blocks(make_request("c2", prompt=c.prompt_token_ids + [1]))[1] == 8
    manager.free(e)
    manager.free(f)


def test_allocate_fails_without_enough_blocks_and_leaves_no_trace(pools: list[BlockPool]) -> None:
    manager = make_manager(pools, num_blocks=3)  # 2 usable blocks
    request = make_request("big", prompt=list(range(12)))
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 12, num_hit_tokens, hits) is None
    assert "big" not in manager.req_to_blocks
    assert manager.block_pool.get_num_free_blocks() == 2


def test_free_hit_blocks_count_against_the_free_pool(pools: list[BlockPool]) -> None:
    manager = make_manager(pools, num_blocks=4)  # 3 usable blocks
    a = make_request("a", prompt=list(range(9)))
    admit(manager, a)
    manager.free(a)
    # b hits 2 free cached blocks and needs 2 more: 4 > 3 free, even though only 2 are new.
    b = make_request("b", prompt=list(range(8)) + [70 + i for i in range(8)])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    assert manager.allocate_slots(b, 8, num_hit_tokens, hits) is None
    assert all(block.ref_cnt == 0 for block in hits)


def test_decode_allocates_a_block_only_when_one_fills(pools: list[BlockPool]) -> None:
    manager = make_manager(pools)
    request = make_request("r", prompt=list(range(6)))
    admit(manager, request)
    assert len(manager.req_to_blocks["r"]) == 2
    request.append_output_token_ids(100)
    assert manager.allocate_slots(request, 1) == []  # token 7 fits in block 2
    request.num_computed_tokens += 1
    request.append_output_token_ids(101)
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens += 1
    # Block 2 is now full of computed tokens, so it is cached.
    assert manager.num_cached_block["r"] == 2
    request.append_output_token_ids(102)
    new = manager.allocate_slots(request, 1)
    assert new is not None and len(new) == 1
    manager.free(request)


def test_caching_disabled(pools: list[BlockPool]) -> None:
    manager = make_manager(pools, enable_caching=False)
    a = make_request("a", prompt=list(range(9)))
    assert admit(manager, a) == 0
    manager.free(a)
    b = make_request("b", prompt=list(range(9)))
    assert manager.get_computed_blocks(b) == ([], 0)
    assert not manager.block_pool.cached_block_hash_to_block and not b.block_hashes


def test_usage_and_reset(pools: list[BlockPool]) -> None:
    manager = make_manager(pools, num_blocks=5)
    a = make_request("a", prompt=list(range(8)))
    admit(manager, a)
    assert manager.usage == 0.5
    assert not manager.reset_prefix_cache()
    manager.free(a)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", prompt=list(range(9))))[1] == 0


def test_blocks_of_a_step_that_never_ran_leave_the_cache(pools: list[BlockPool]) -> None:
    manager = make_manager(pools)
    request = make_request("r", prompt=list(range(8)))
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    manager.allocate_slots(request, 8, num_hit_tokens, hits)
    # Both blocks are cached as soon as they are scheduled ...
    assert manager.num_cached_block["r"] == 2
    # ... but the request is freed before its step ran (num_computed_tokens still 0).
    manager.free(request)
    assert not manager.block_pool.cached_block_hash_to_block
    # Once computed, blocks keep their hashes when freed.
    request.num_computed_tokens = 0
    manager.allocate_slots(request, 8)
    request.num_computed_tokens = 8
    manager.free(request)
    assert len(manager.block_pool.cached_block_hash_to_block) == 2


@pytest.mark.parametrize("enable_caching", [True, False])
def test_below_the_kv_boundary_allocate_slots_has_nothing_to_do(
    pools: list[BlockPool], enable_caching: bool
) -> None:
    """The scheduler skips allocate_slots while a running request's computed + new tokens stay
    below its `next_kv_boundary`: there the call would allocate and cache nothing."""
    manager = make_manager(pools, num_blocks=32, enable_caching=enable_caching)
    request = make_request("r", prompt=6, max_tokens=None)
    admit(manager, request)
    num_skippable = 0
    for token in range(3 * BLOCK_SIZE + 1):
        request.append_output_token_ids(100 + token)
        skippable = request.num_computed_tokens + 1 < request.next_kv_boundary
        blocks = list(manager.req_to_blocks["r"])
        num_cached = manager.num_cached_block.get("r", 0)
        new_blocks = manager.allocate_slots(request, 1)
        if skippable:
            num_skippable += 1
            assert new_blocks == [] and manager.req_to_blocks["r"] == blocks
            assert manager.num_cached_block.get("r", 0) == num_cached
        request.num_computed_tokens += 1
    # Caching adds a boundary per block (the block it fills), besides the one for new blocks.
    assert num_skippable == 3 * BLOCK_SIZE + 1 - (6 if enable_caching else 3)
    manager.free(request)
