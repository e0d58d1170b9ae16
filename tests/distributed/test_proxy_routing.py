"""The proxy's routing over real instances that publish KV events: requests sharing a prefix go
where it is cached, a conversation's next turn goes to the decode instance that holds the
earlier ones (which then pulls only the blocks it lacks), short uncached prompts skip the
prefill leg (X-PD-Path: local; reason=policy), and a leg whose instance died is retried on
another one. Outputs stay the reference's tokens throughout."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.utils import get_open_port
from tests.utils.pd import greedy_body, start_instance, wait_all_pools_full
from tests.utils.server import RemoteServer, descendants, start_together
from tests.utils.tiny_models import hf_greedy

# Four instances that publish KV events (about 50 s to start on 2 cores) and a proxy: the
# default stage stays under 15 minutes; the router's decisions run there in
# tests/unit/proxy/test_routing.py.
pytestmark = pytest.mark.slow

BLOCK = 16
MAX_TOKENS = 4


def events_config() -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{get_open_port()}",
        "replay_endpoint": f"tcp://*:{get_open_port()}",
        "topic": "kv@test",
    }
    return ["--kv-events-config", json.dumps(config), "--block-size", str(BLOCK)]


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def instances(model: str) -> Iterator[dict[str, list[RemoteServer]]]:
    p1, p2, d1, d2 = start_together(
        lambda: start_instance(model, "kv_producer", extra_args=events_config()),
        lambda: start_instance(model, "kv_producer", extra_args=events_config()),
        lambda: start_instance(model, "kv_consumer", extra_args=events_config()),
        lambda: start_instance(model, "kv_consumer", extra_args=events_config()),
    )
    with p1, p2, d1, d2:
        yield {"prefill": [p1, p2], "decode": [d1, d2]}


def start_proxy(instances: dict[str, list[RemoteServer]], model: str, *flags: str) -> RemoteServer:
    args = ["proxy", "--model", model, *flags]
    for role in ("prefill", "decode"):
        args += [f"--{role}", *(s.url.removeprefix("http://") for s in instances[role])]
    return RemoteServer(args)


def wait_for_events(proxy: RemoteServer, timeout: float = 30) -> None:
    """Until the proxy follows every instance's events (it finds them through /server_info)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{proxy.url}/health").json()
        if all(i["kv_events"] for role in ("prefill", "decode") for i in health[role]):
            return
        time.sleep(0.2)
    raise AssertionError(f"the proxy does not follow every instance's KV events: {health}")


@pytest.fixture(scope="module")
def proxy(instances: dict[str, list[RemoteServer]], model: str) -> Iterator[RemoteServer]:
    # Every request through the prefill leg here: the policy has its own test.
    with start_proxy(instances, model, "--pd-min-uncached-tokens", "0") as proxy:
        wait_for_events(proxy)
        yield proxy
        assert proxy.stop() == []


def send(proxy: RemoteServer, model: str, prompt: list[int], **fields: object) -> httpx.Response:
    body = {**greedy_body(model, prompt, MAX_TOKENS), **fields}
    resp = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def tokens(resp: httpx.Response) -> list[int]:
    return resp.json()["choices"][0]["token_ids"]


def test_shared_prefixes_land_where_they_are_cached(
    proxy: RemoteServer, instances: dict[str, list[RemoteServer]], model: str
) -> None:
    rng = random.Random(0)
    # Five prefixes over two prefill instances: round robin alone would send a prefix's later
    # requests elsewhere (with four, it lands each where it was cached by chance).
    num = 5
    prefixes = [[rng.randrange(3, 250) for _ in range(4 * BLOCK)] for _ in range(num)]
    prompts, placed = [], []
    for round_ in range(3):
        for prefix in prefixes:
            prompt = prefix + [rng.randrange(3, 250) for _ in range(5 + round_)]
            resp = send(proxy, model, prompt)
            prompts.append(prompt)
            placed.append(resp.headers["X-PD-Prefill-Instance"])
            assert resp.headers["X-PD-Path"] == "remote"
            time.sleep(0.1)  # the stored event reaches the proxy within a step or two
    first = placed[:num]
    assert len(set(first)) == 2, f"the first of each prefix is spread by load: {first}"
    # Each prefix's later requests went to the instance that computed it first.
    assert placed[num : 2 * num] == first and placed[2 * num :] == first
    reference = hf_greedy(Path(model), prompts[-num:], MAX_TOKENS)
    assert [tokens(send(proxy, model, p)) for p in prompts[-num:]] == reference
    hits = sum(s.metric("prefix_cache_hits_total") for s in instances["prefill"])
    assert hits >= 2 * num * 4 * BLOCK  # every later request found its whole prefix
    wait_all_pools_full(proxy)


def test_next_turn_goes_to_the_decode_instance_holding_the_last(
    proxy: RemoteServer, instances: dict[str, list[RemoteServer]], model: str
) -> None:
    rng = random.Random(1)
    turn = [rng.randrange(3, 250) for _ in range(3 * BLOCK)]
    decode_of = []
    for _ in range(3):
        resp = send(proxy, model, turn)
        decode_of.append(resp.headers["X-PD-Decode-Instance"])
        turn = turn + tokens(resp) + [rng.randrange(3, 250) for _ in range(2 * BLOCK)]
        time.sleep(0.1)
    assert len(set(decode_of)) == 1
    decode = next(s for s in instances["decode"] if s.url == decode_of[0])
    # Turn 3 found turns 1-2 in its decode instance's cache: only the rest came over.
    local = decode.metric("prompt_tokens_by_source_total", source="local_cache_hit")
    assert local >= 2 * 3 * BLOCK
    wait_all_pools_full(proxy)


def test_short_uncached_prompt_skips_the_prefill_leg(
    instances: dict[str, list[RemoteServer]], model: str
) -> None:
    with start_proxy(instances, model, "--pd-min-uncached-tokens", "24") as proxy:
        wait_for_events(proxy)
        short = [5, 6, 7, 8, 9, 10, 11, 12]
        resp = send(proxy, model, short)
        assert resp.headers["X-PD-Path"] == "local; reason=policy"
        assert tokens(resp) == hf_greedy(Path(model), [short], MAX_TOKENS)[0]
        assert proxy.metric("proxy_requests_total", path="local", reason="policy") == 1
        long = list(range(3, 3 + 40))
        assert send(proxy, model, long).headers["X-PD-Path"] == "remote"
        # Its blocks are on the decode instance now: a follow-up with a short new tail is local.
        time.sleep(0.2)
        resp = send(proxy, model, long + [7, 8, 9])
        assert resp.headers["X-PD-Path"] == "local; reason=policy"
        assert tokens(resp) == hf_greedy(Path(model), [long + [7, 8, 9]], MAX_TOKENS)[0]
        # The proxy salts its hashes as the instances do: under a cache_salt the blocks above
        # count for nothing, and a follow-up finds its own salt's.
        salt = "tenant-a"
        assert send(proxy, model, long + [7, 8], cache_salt=salt).headers["X-PD-Path"] == "remote"
        time.sleep(0.2)
        resp = send(proxy, model, long + [7, 8, 9], cache_salt=salt)
        assert resp.headers["X-PD-Path"] == "local; reason=policy"
        assert proxy.stop() == []


def test_strict_pd_never_skips_the_prefill_leg(
    instances: dict[str, list[RemoteServer]], model: str
) -> None:
    with start_proxy(instances, model, "--strict-pd") as proxy:
        assert send(proxy, model, [5, 6, 7, 8]).headers["X-PD-Path"] == "remote"
        assert proxy.stop() == []


def test_a_dead_instance_s_leg_is_retried_on_another(model: str) -> None:
    """Prefill and decode legs alike: the instance the router chose is gone (killed between
    legs of earlier requests), the leg goes to the other one, and the client sees nothing."""
    p1, p2, d1, d2 = start_together(
        lambda: start_instance(model, "kv_producer"),
        lambda: start_instance(model, "kv_producer"),
        lambda: start_instance(model, "kv_consumer"),
        lambda: start_instance(model, "kv_consumer"),
    )
    with p1, p2, d1, d2:
        args = ["proxy", "--model", model, "--pd-min-uncached-tokens", "0"]
        for role, pair in (("prefill", (p1, p2)), ("decode", (d1, d2))):
            args += [f"--{role}", *(s.url.removeprefix("http://") for s in pair)]
        with RemoteServer(args) as proxy:
            prompt = list(range(10, 10 + 3 * BLOCK))
            reference = hf_greedy(Path(model), [prompt], MAX_TOKENS)[0]
            # Events off: the proxy presumes a prompt cached where it sent it, so the same
            # prompt goes back to the same instances, which are then killed.
            first = send(proxy, model, prompt)
            p_url, d_url = (
                first.headers["X-PD-Prefill-Instance"],
                first.headers["X-PD-Decode-Instance"],
            )
            for server in (p1, p2, d1, d2):
                if server.url in (p_url, d_url):
                    for pid in [server.proc.pid, *descendants(server.proc.pid)]:
                        os.kill(pid, signal.SIGKILL)
            resp = send(proxy, model, prompt)
            assert resp.headers["X-PD-Path"] == "remote"
            assert resp.headers["X-PD-Prefill-Instance"] != p_url
            assert resp.headers["X-PD-Decode-Instance"] != d_url
            assert tokens(resp) == reference
            alive = [s for s in (p1, p2, d1, d2) if s.url not in (p_url, d_url)]
            for server in alive:
                server.wait_pool_full()
            assert proxy.stop() == []
