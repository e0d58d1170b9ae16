"""The proxy's routing rules, in-process: longest cached prefix under a load bound, ties, round
robin when nothing is cached, the TTL of presumed blocks, retries excluding an instance,
conditional disaggregation, and prompt hashes equal to the ones the instances publish."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pdserve.distributed.kv_event_subscriber import CachedBlocks
from pdserve.distributed.kv_events import external_block_hash
from pdserve.protocol.errors import OpenAIError
from pdserve.proxy import routing as proxy_routing
from pdserve.proxy.instances import InstancePool
from pdserve.proxy.routing import (
    Router,
    RoutingConfig,
    local_policy,
    prompt_block_hashes,
)
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.kv_cache_utils import extend_block_hashes, request_block_hasher

BLOCK = 4


@pytest.fixture
def pool() -> Iterator[InstancePool]:
    yield InstancePool("prefill", [f"127.0.0.1:{9000 + i}" for i in range(3)], 1.0)


def router_with_events(pool: InstancePool, held: list[list[int]], **config: object) -> Router:
    router = Router(pool, RoutingConfig(**config))  # type: ignore[arg-type]
    router.block_size = BLOCK
    for instance, hashes in zip(pool.instances, held, strict=True):
        cached = CachedBlocks()
        cached.hashes = set(hashes)
        router.caches[instance.url].from_events = cached
    return router


def test_prompt_hashes_are_the_instances_block_hashes() -> None:
    tokens = list(range(100, 118))
    engine: list[bytes] = []
    extend_block_hashes(engine, tokens, BLOCK)
    # The block of the last token is never a hit (it is always computed): 17 // 4 = 4 blocks.
    assert prompt_block_hashes(tokens, BLOCK) == [external_block_hash(h) for h in engine[:4]]
    assert prompt_block_hashes(tokens[:16], BLOCK) == [external_block_hash(h) for h in engine[:3]]


def test_a_salted_prompt_hashes_as_the_instances_hash_its_request() -> None:
    tokens = list(range(100, 118))
    request = Request("r", tokens, SamplingParams(), None, cache_salt="tenant-a")
    request_block_hasher(BLOCK)(request)
    salted = prompt_block_hashes(tokens, BLOCK, "tenant-a")
    assert salted == [external_block_hash(h) for h in request.block_hashes[:4]]
    assert not set(salted) & set(prompt_block_hashes(tokens, BLOCK))
    assert not set(salted) & set(prompt_block_hashes(tokens, BLOCK, "tenant-b"))


def test_longest_cached_prefix_wins(pool: InstancePool) -> None:
    hashes = [1, 2, 3, 4]
    router = router_with_events(pool, [[1], [1, 2, 3], [2, 3, 4]])
    route = router.pick(hashes)
    assert route.instance is pool.instances[1] and route.matched_blocks == 3


def test_load_bound_overrides_the_cache(pool: InstancePool) -> None:
    router = router_with_events(pool, [[1, 2, 3], [1], []], max_load_imbalance=2)
    pool.instances[0].in_flight = 3  # 3 above the least loaded (0): over the bound of 2
    assert router.pick([1, 2, 3]).instance is pool.instances[1]
    pool.instances[0].in_flight = 2  # at the bound: still wins
    assert router.pick([1, 2, 3]).instance is pool.instances[0]


def test_tie_goes_to_the_less_loaded(pool: InstancePool) -> None:
    router = router_with_events(pool, [[1, 2], [1, 2], []])
    pool.instances[0].in_flight = 1
    assert router.pick([1, 2]).instance is pool.instances[1]


def test_nothing_cached_is_round_robin_among_the_least_loaded(pool: InstancePool) -> None:
    router = router_with_events(pool, [[], [], []])
    pool.instances[2].in_flight = 1
    picked = {router.pick([7, 8]).instance.url for _ in range(4)}
    assert picked == {pool.instances[0].url, pool.instances[1].url}


def test_without_events_a_routed_prompt_is_presumed_cached_for_the_ttl(
    pool: InstancePool,
) -> None:
    router = Router(pool, RoutingConfig(cache_ttl_s=0.2))
    router.block_size = BLOCK
    first = router.pick([5, 6])
    assert first.matched_blocks == 0
    again = [router.pick([5, 6]) for _ in range(3)]
    assert all(r.instance is first.instance and r.matched_blocks == 2 for r in again)
    assert router.status()[pool.instances.index(first.instance)]["cached_blocks"] == 2
    time.sleep(0.25)
    assert router.pick([5, 6]).matched_blocks == 0  # expired: no longer presumed


def test_retry_excludes_the_failed_instance(pool: InstancePool) -> None:
    router = router_with_events(pool, [[1, 2], [1], []])
    assert router.pick([1, 2], exclude=pool.instances[0]).instance is pool.instances[1]
    for instance in pool.instances[1:]:
        instance.healthy, instance.last_error = False, "down"
    with pytest.raises(OpenAIError, match="No healthy prefill instance besides"):
        router.pick([1, 2], exclude=pool.instances[0])


def test_round_robin_policy_ignores_the_cache(pool: InstancePool) -> None:
    router = router_with_events(pool, [[1, 2], [], []], policy="round_robin")
    assert router.hashes(list(range(20))) == []
    picked = [router.pick([]).instance.url for _ in range(3)]
    assert sorted(picked) == sorted(i.url for i in pool.instances)


def test_local_policy(pool: InstancePool) -> None:
    decode_pool = InstancePool("decode", ["127.0.0.1:9100"], 1.0)
    router = router_with_events(decode_pool, [[1, 2]])
    route = router.pick([1, 2, 3])  # 2 blocks cached: 8 of the prompt's tokens
    config = RoutingConfig(min_uncached_tokens=8, max_prefill_in_flight=2)
    why = local_policy(config, route, 15, BLOCK, pool)
    assert why is not None and "7 prompt tokens are not cached" in why
    assert local_policy(config, route, 16, BLOCK, pool) is None
    assert local_policy(config, route, 0, BLOCK, pool) is None  # no tokens known: no opinion
    for instance in pool.instances:
        instance.in_flight = 2
    assert "every prefill instance" in (local_policy(config, route, 16, BLOCK, pool) or "")
    off = RoutingConfig(min_uncached_tokens=0, max_prefill_in_flight=0)
    assert local_policy(off, route, 1, BLOCK, pool) is None


def test_bad_flags_are_named() -> None:
    with pytest.raises(ValueError, match="--routing"):
        RoutingConfig(policy="random")
    with pytest.raises(ValueError, match="--pd-min-uncached-tokens"):
        RoutingConfig(min_uncached_tokens=-1)
    with pytest.raises(ValueError, match="--routing-cache-ttl"):
        RoutingConfig(cache_ttl_s=0)


def test_presumed_blocks_are_pruned_of_expired_ones(
    pool: InstancePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(proxy_routing, "_MAX_PRESUMED_BLOCKS", 4)
    cache = proxy_routing.InstanceCache()
    cache.note_routed([1, 2, 3], now=0.0, ttl_s=10.0)
    cache.note_routed([4, 5], now=20.0, ttl_s=10.0)  # 5 entries: 1-3 have expired
    assert set(cache.routed) == {4, 5}
    assert cache.matched([4, 5], now=21.0) == 2 and cache.matched([1], now=21.0) == 0
