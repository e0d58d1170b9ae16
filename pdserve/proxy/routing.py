"""Where the proxy sends a request: to the instance that holds the longest cached prefix of its
prompt, unless that instance carries clearly more requests than the least loaded one
(docs/proxy.md, "Routing").

What an instance holds comes from its KV cache events when it publishes them
(docs/kv_events.md); otherwise from the proxy's own decisions: a prompt routed to an instance
is presumed cached there for `cache_ttl_s`. Prompts are hashed block by block exactly as the
instances hash them (scheduler/kv_cache_utils.py: the same chained BLAKE2s, the same constant
root, the request's cache_salt in its first block), so a prompt's hashes are the ones the events
name.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pdserve.distributed.kv_event_subscriber import CachedBlocks, KVEventSubscriber
from pdserve.distributed.kv_events import external_block_hash
from pdserve.protocol.errors import OpenAIError
from pdserve.proxy.instances import Instance, InstancePool
from pdserve.proxy.prompts import PromptTokens
from pdserve.scheduler.kv_cache_utils import extend_block_hashes
from pdserve.validation import check_choice

logger = logging.getLogger(__name__)

ROUTING_POLICIES = ("cache_aware", "round_robin")


@dataclass
class RoutingConfig:
    policy: str = "cache_aware"
    # An instance with the longest prefix still wins while it has at most this many requests
    # in flight more than the least loaded one: one long prefill costs the requests queued
    # behind it their TTFT, so a cache hit is only worth a short queue.
    max_load_imbalance: int = 4
    # Events off: how long a routed prompt's blocks count as cached on the instance it went
    # to. Past it, the instance has likely evicted them under other requests.
    cache_ttl_s: float = 300.0
    # Conditional disaggregation: a prompt with fewer tokens than this not cached on its decode
    # instance is prefilled there, without a prefill leg (0: never). A lone short request is
    # served sooner that way (no hop, no pull), but its prefill stalls every request decoding
    # there; 64 tokens keep that stall under one decode step (docs/proxy.md has the figures).
    min_uncached_tokens: int = 64
    # ... and so is every request while each prefill instance has this many in flight (0: never).
    max_prefill_in_flight: int = 16

    def __post_init__(self) -> None:
        check_choice("--routing", self.policy, ROUTING_POLICIES)
        if self.cache_ttl_s <= 0:
            raise ValueError(f"--routing-cache-ttl must be > 0, got {self.cache_ttl_s}.")
        for flag, value in (
            ("--max-load-imbalance", self.max_load_imbalance),
            ("--pd-min-uncached-tokens", self.min_uncached_tokens),
            ("--pd-max-prefill-in-flight", self.max_prefill_in_flight),
        ):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}.")


class InstanceCache:
    """The blocks one instance is believed to hold: its events' map, or what was routed to it."""

    def __init__(self) -> None:
        self.from_events: CachedBlocks | None = None
        # Events off: block hash -> when the presumption expires.
        self.routed: dict[int, float] = {}

    def matched(self, hashes: list[int], now: float) -> int:
        """How many leading blocks of `hashes` the instance holds."""
        if self.from_events is not None:
            held = self.from_events.hashes
            for i, h in enumerate(hashes):
                if h not in held:
                    return i
            return len(hashes)
        routed = self.routed
        for i, h in enumerate(hashes):
            expiry = routed.get(h)
            if expiry is None or expiry < now:
                return i
        return len(hashes)

    def note_routed(self, hashes: list[int], now: float, ttl_s: float) -> None:
        if self.from_events is None:
            routed = self.routed
            expiry = now + ttl_s
            for h in hashes:
                routed[h] = expiry
            if len(routed) > _MAX_PRESUMED_BLOCKS:
                self.routed = {h: e for h, e in routed.items() if e >= now}


# Bounds the map of routed blocks when events are off (expired ones are dropped past it): far
# above any instance's block count.
_MAX_PRESUMED_BLOCKS = 1 << 20
_DISCOVERY_INTERVAL_S = 2.0


@dataclass
class Route:
    instance: Instance
    # Leading blocks of the prompt the instance is believed to hold.
    matched_blocks: int


class Router:
    """Picks instances of one pool by cache and load; tracks what each holds."""

    def __init__(self, pool: InstancePool, config: RoutingConfig) -> None:
        self.pool = pool
        self.config = config
        self.caches = {i.url: InstanceCache() for i in pool.instances}
        self._subscribers: list[KVEventSubscriber] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # The instances' KV block size, from their /server_info: prompts are hashed in blocks
        # of it. None until one answered: requests are then routed by load alone.
        self.block_size: int | None = None

    def hashes(self, token_ids: list[int], cache_salt: str | None = None) -> list[int]:
        if not token_ids or self.block_size is None or self.config.policy != "cache_aware":
            return []
        return prompt_block_hashes(token_ids, self.block_size, cache_salt)

    def pick(self, hashes: list[int], exclude: Instance | None = None) -> Route:
        """The instance for a prompt of these block hashes; `exclude`: one whose hop just
        failed (a retry goes elsewhere). Raises the pool's 503 when none is left."""
        healthy = [i for i in self.pool.instances if i.healthy and i is not exclude]
        if not healthy:
            raise OpenAIError(
                503,
                f"No healthy {self.pool.role} instance"
                + (f" besides {exclude.url}" if exclude is not None else "")
                + ": "
                + "; ".join(f"{i.url}: {i.last_error}" for i in self.pool.instances),
            )
        least = min(i.in_flight for i in healthy)
        candidates = [i for i in healthy if i.in_flight <= least + self.config.max_load_imbalance]
        best, matched = None, 0
        if self.config.policy == "cache_aware" and hashes:
            now = time.monotonic()
            best_key = (0, 0)
            for instance in candidates:
                hit = self.caches[instance.url].matched(hashes, now)
                key = (hit, -instance.in_flight)
                if hit and key > best_key:
                    best, best_key = instance, key
            matched = best_key[0]
        if best is None:
            # Nothing cached where it may go: round robin among the least loaded.
            best = self.pool.pick(among=[i for i in candidates if i.in_flight == least])
        if hashes:
            self.caches[best.url].note_routed(hashes, time.monotonic(), self.config.cache_ttl_s)
        return Route(best, matched)

    def status(self) -> list[dict[str, Any]]:
        """Each instance's health, load and what the router knows of its cache."""
        out = []
        for entry, instance in zip(self.pool.status(), self.pool.instances, strict=True):
            cache = self.caches[instance.url]
            events = cache.from_events
            out.append(
                {
                    **entry,
                    "in_flight": instance.in_flight,
                    "kv_events": events is not None,
                    "cached_blocks": len(events.hashes if events is not None else cache.routed),
                }
            )
        return out

    def follow_events(self, url: str, endpoint: str, replay: str | None) -> None:
        """Take the cache map of the instance at `url` from its KV events, from now on."""
        cache = self.caches[url]
        if cache.from_events is not None:
            return
        subscriber = KVEventSubscriber(endpoint, replay)
        cached = CachedBlocks()
        for batch in subscriber.replay_from(0):
            cached.apply(batch)
        cache.from_events = cached
        cache.routed.clear()
        self._subscribers.append(subscriber)
        thread = threading.Thread(
            target=self._listen, args=(subscriber, cached), name="proxy-kv-events", daemon=True
        )
        thread.start()
        self._threads.append(thread)
        logger.info("%s instance %s: cache map from KV events at %s", self.pool.role, url, endpoint)

    def _listen(self, subscriber: KVEventSubscriber, cached: CachedBlocks) -> None:
        while not self._stop.is_set():
            for batch in subscriber.poll(100):
                cached.apply(batch)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)
        for subscriber in self._subscribers:
            subscriber.close()


async def discover(router: Router, instance: Instance, prompts: PromptTokens) -> None:
    """Learn an instance's block size and tokenizer and, when it publishes them, follow its KV
    events."""
    resp = await instance.client.get("/server_info", params={"config_format": "json"})
    resp.raise_for_status()
    config = resp.json()["vllm_config"]
    if prompts.tokenizer is None:
        try:
            await asyncio.to_thread(prompts.load, config["model_config"]["model"])
        except (ValueError, OSError) as e:
            logger.warning(
                "No tokenizer for %s (%s): requests are routed by load alone (give --model)",
                instance.url,
                e,
            )
    block_size = config["cache_config"]["block_size"]
    if router.block_size is None:
        router.block_size = block_size
    elif router.block_size != block_size:
        logger.warning(
            "%s instance %s has block size %d, others %d: its cache map is not used",
            router.pool.role,
            instance.url,
            block_size,
            router.block_size,
        )
        return
    events = config.get("kv_events_config") or {}
    if events.get("enable_kv_cache_events") and events.get("publisher") == "zmq":
        host = urlsplit(instance.url).hostname or "127.0.0.1"
        endpoint = _reachable(events["endpoint"], host)
        replay = events.get("replay_endpoint")
        await asyncio.to_thread(
            router.follow_events, instance.url, endpoint, replay and _reachable(replay, host)
        )


async def discover_all(routers: list[Router], prompts: PromptTokens) -> None:
    """Each instance's /server_info once it answers (retried with the health checks' period)."""
    pending = [(r, i) for r in routers for i in r.pool.instances]
    while pending:
        left = []
        for router, instance in pending:
            try:
                await discover(router, instance, prompts)
            except Exception as e:  # not up yet, or an instance without /server_info
                logger.debug("%s: no server info yet (%s)", instance.url, e)
                left.append((router, instance))
        pending = left
        if pending:
            await asyncio.sleep(_DISCOVERY_INTERVAL_S)


def _reachable(endpoint: str, host: str) -> str:
    """A bound address as a peer connects to it: a wildcard host becomes the instance's."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint.removeprefix(wildcard)}"
    return endpoint


def local_policy(
    config: RoutingConfig,
    decode: Route,
    num_prompt_tokens: int,
    block_size: int | None,
    prefill_pool: InstancePool,
) -> str | None:
    """Why the decode instance should prefill this request itself (X-PD-Path: local;
    reason=policy), or None to hand it over."""
    if num_prompt_tokens and block_size is not None and config.min_uncached_tokens:
        uncached = num_prompt_tokens - decode.matched_blocks * block_size
        if uncached < config.min_uncached_tokens:
            return (
                f"{uncached} prompt tokens are not cached on {decode.instance.url}, fewer than "
                f"--pd-min-uncached-tokens {config.min_uncached_tokens}"
            )
    limit = config.max_prefill_in_flight
    healthy = [i for i in prefill_pool.instances if i.healthy]
    if limit and healthy and all(i.in_flight >= limit for i in healthy):
        return f"every prefill instance has {limit} or more requests in flight"
    return None


def prompt_block_hashes(
    token_ids: list[int], block_size: int, cache_salt: str | None = None
) -> list[int]:
    """The hashes, as events carry them, of the prompt's blocks a prefix-cache hit may cover
    (not the block of the last token, which an instance always computes); salted as the
    instances salt the request's (its `cache_salt`)."""
    hashes: list[bytes] = []
    extend_block_hashes(
        hashes,
        token_ids[: (len(token_ids) - 1) // block_size * block_size],
        block_size,
        cache_salt,
    )
    return [external_block_hash(h) for h in hashes]


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    d = RoutingConfig()
    parser.add_argument(
        "--routing", choices=ROUTING_POLICIES, default=d.policy, help="docs/proxy.md, Routing"
    )
    parser.add_argument(
        "--max-load-imbalance",
        type=int,
        default=d.max_load_imbalance,
        help="requests in flight above the least loaded instance's that still let an instance "
        "win on its cached prefix",
    )
    parser.add_argument(
        "--routing-cache-ttl",
        type=float,
        default=d.cache_ttl_s,
        help="without KV events: seconds a routed prompt counts as cached where it went",
    )
    parser.add_argument(
        "--pd-min-uncached-tokens",
        type=int,
        default=d.min_uncached_tokens,
        help="prompts with fewer tokens not cached on their decode instance are prefilled "
        "there, with no prefill leg (0: never)",
    )
    parser.add_argument(
        "--pd-max-prefill-in-flight",
        type=int,
        default=d.max_prefill_in_flight,
        help="while every prefill instance has this many requests in flight, decode "
        "instances prefill new ones themselves (0: never)",
    )


def routing_config(args: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(
        args.routing,
        args.max_load_imbalance,
        args.routing_cache_ttl,
        args.pd_min_uncached_tokens,
        args.pd_max_prefill_in_flight,
    )


def routing_flags(args: argparse.Namespace) -> list[str]:
    """The routing flags as `pdserve proxy` takes them (pdserve launch passes them on)."""
    c = routing_config(args)
    return [
        "--routing", c.policy,
        "--max-load-imbalance", str(c.max_load_imbalance),
        "--routing-cache-ttl", str(c.cache_ttl_s),
        "--pd-min-uncached-tokens", str(c.min_uncached_tokens),
        "--pd-max-prefill-in-flight", str(c.max_prefill_in_flight),
    ]  # fmt: skip
