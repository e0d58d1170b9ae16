"""What the proxy's routing decision costs per request, measured in-process.

Eight instances per pool, each with a cache map of 20,000 blocks (as from KV events), one of
them holding the request's prefix. Timed separately, per request: tokenizing the prompt (the
default model's tokenizer, a chat request), hashing its blocks, and picking the instance (the
longest cached prefix under the load bound). Printed: median and p99 in microseconds, for
prompts of several lengths. No peer runs this step: vllm-router's `kv_aware` asks an instance to
render the prompt over HTTP instead (a round trip, about 1 ms here: docs/proxy.md).

Usage: python benchmarks/proxy_routing_cost.py [--instances 8] [--requests 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.distributed.kv_event_subscriber import CachedBlocks  # noqa: E402
from pdserve.protocol.chat import ChatCompletionRequest
from pdserve.proxy.instances import InstancePool  # noqa: E402
from pdserve.proxy.prompts import PromptTokens  # noqa: E402
from pdserve.proxy.routing import Router, RoutingConfig  # noqa: E402

BLOCK = 16


def percentiles(samples: list[float]) -> str:
    samples = sorted(samples)
    p99 = samples[int(0.99 * (len(samples) - 1))]
    return f"{statistics.median(samples) * 1e6:8.1f} / {p99 * 1e6:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--words", type=int, nargs="+", default=[50, 200, 800])
    args = parser.parse_args()
    rng = random.Random(0)
    pool = InstancePool("prefill", [f"127.0.0.1:{9000 + i}" for i in range(args.instances)], 1.0)
    router = Router(pool, RoutingConfig())
    router.block_size = BLOCK
    for i, instance in enumerate(pool.instances):
        cached = CachedBlocks()
        cached.hashes = {rng.getrandbits(64) for _ in range(20_000)}
        router.caches[instance.url].from_events = cached
        instance.in_flight = i % 3
    prompts = PromptTokens()
    prompts.load(None)  # the default model's tokenizer
    words = "the of and to in is was for on that with as by at from his her it an were".split()
    print(f"{args.instances} instances, {args.requests} requests each; median / p99 in us")
    print(f"{'prompt':>14} | {'tokenize':>17} | {'hash blocks':>17} | {'pick':>17} | hash+pick")
    for n in args.words:
        system = " ".join(rng.choice(words) for _ in range(n))
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": "Tell me more about it."},
            ],
        }
        token_ids = prompts.of(ChatCompletionRequest.model_validate(body))
        # One instance holds the prompt's blocks, as if it had served it before.
        holder = pool.instances[-1]
        router.caches[holder.url].from_events.hashes.update(router.hashes(token_ids))
        tokenize, hashing, picking, both = [], [], [], []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            ids = prompts.of(ChatCompletionRequest.model_validate(body))
            t1 = time.perf_counter()
            hashes = router.hashes(ids)
            t2 = time.perf_counter()
            route = router.pick(hashes)
            t3 = time.perf_counter()
            tokenize.append(t1 - t0)
            hashing.append(t2 - t1)
            picking.append(t3 - t2)
            both.append(t3 - t1)
        assert route.instance is holder, (route, holder.url, len(hashes))
        assert route.matched_blocks == len(hashes), (route.matched_blocks, len(hashes))
        print(
            f"{len(ids):>7} tokens | {percentiles(tokenize)} | {percentiles(hashing)} | "
            f"{percentiles(picking)} | {percentiles(both)}",
            flush=True,
        )
    for instance in pool.instances:  # the pool's clients were never used; close them cleanly
        instance.client = httpx.AsyncClient()


if __name__ == "__main__":
    main()
