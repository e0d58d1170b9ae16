"""pdserve instances behind vLLM's own router (`vllm-router`, installed in its own venv by the
fixture): its PD mode hands every request over token-exactly, and its `kv_aware` prefill
policy, fed by the instances' KV events and render endpoints, sends requests that share a
prefix to the instance that caches it: a prefix hit rate well above round robin's."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.utils import get_open_port
from tests.utils.pd import greedy_body, start_instance
from tests.utils.server import RemoteServer, start_together
from tests.utils.tiny_models import hf_greedy
from tests.utils.vllm_router import Router

pytestmark = pytest.mark.slow  # installs vllm-router from PyPI on first use

BLOCK = 16  # vllm-router 0.1.17 takes no other
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def deployment(model: str) -> Iterator[dict[str, list]]:
    """Two prefill instances publishing KV events (empty topic: the router's), one decode."""
    ports = [get_open_port() for _ in range(2)]

    def events(port: int) -> list[str]:
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
        return ["--kv-events-config", json.dumps(config), "--block-size", str(BLOCK)]

    p1, p2, d = start_together(
        lambda: start_instance(model, "kv_producer", extra_args=events(ports[0])),
        lambda: start_instance(model, "kv_producer", extra_args=events(ports[1])),
        lambda: start_instance(model, "kv_consumer", extra_args=["--block-size", str(BLOCK)]),
    )
    with p1, p2, d:
        yield {"prefill": [p1, p2], "decode": [d], "event_ports": ports}


def prefix_stats(prefill: list[RemoteServer]) -> tuple[float, float]:
    return (
        sum(s.metric("prefix_cache_hits_total") for s in prefill),
        sum(s.metric("prefix_cache_queries_total") for s in prefill),
    )


def run_workload(
    router: Router, model: str, seed: int, prefill: list[RemoteServer]
) -> tuple[float, list[list[int]], list[list[int]]]:
    """Five prefixes of 6 blocks each, in three rounds of one request each (its own tail);
    returns the prefill instances' prefix hit rate over them and the prompts and outputs."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 250) for _ in range(6 * BLOCK)] for _ in range(5)]
    order = [i for _ in range(3) for i in range(5)]
    hits, queries = prefix_stats(prefill)
    prompts, outputs = [], []
    for i in order:
        prompt = prefixes[i] + [rng.randrange(3, 250) for _ in range(5)]
        resp = httpx.post(
            f"{router.url}/v1/completions", json=greedy_body(model, prompt, MAX_TOKENS), timeout=60
        )
        assert resp.status_code == 200, resp.text
        prompts.append(prompt)
        outputs.append(resp.json()["choices"][0]["token_ids"])
        time.sleep(0.2)  # the stored events reach the router
    hits_after, queries_after = prefix_stats(prefill)
    return (hits_after - hits) / (queries_after - queries), prompts, outputs


def urls(servers: list[RemoteServer]) -> list[str]:
    return [s.url for s in servers]


def test_kv_aware_routes_to_the_cached_prefix(
    deployment: dict[str, list], model: str, tmp_path: Path
) -> None:
    prefill, decode = deployment["prefill"], deployment["decode"]
    events = [
        f"{s.url}=tcp://127.0.0.1:{port}" for s, port in zip(prefill, deployment["event_ports"])
    ]
    kv_aware = ["--prefill-policy", "kv_aware", "--decode-policy", "round_robin"]
    for flag in events:
        kv_aware += ["--pd-kv-events", flag]
    with Router(urls(prefill), urls(decode), *kv_aware, log=tmp_path / "kv_aware.log") as router:
        aware, prompts, outputs = run_workload(router, model, 1, prefill)
        log = router.log_path.read_text()
    assert "render_unavailable" not in log
    round_robin = ["--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
    with Router(urls(prefill), urls(decode), *round_robin, log=tmp_path / "rr.log") as router:
        blind, _, _ = run_workload(router, model, 2, prefill)
    print(f"prefix hit rate through vllm-router: kv_aware {aware:.2f}, round robin {blind:.2f}")
    # kv_aware: each prefix computed once, then hit (2 of 3). Round robin computes a prefix
    # once on each instance it reaches: over two instances and an odd number of prefixes, a
    # prefix's second request goes to the other instance, its third back (1 of 3 hit).
    assert aware >= blind + 0.2, (aware, blind)
    assert outputs[:3] == hf_greedy(Path(model), prompts[:3], MAX_TOKENS)
    for server in prefill + decode:
        server.wait_pool_full()


def test_round_robin_pd_mode_is_token_exact(
    deployment: dict[str, list], model: str, tmp_path: Path
) -> None:
    prefill, decode = deployment["prefill"], deployment["decode"]
    with Router(urls(prefill), urls(decode), log=tmp_path / "router.log") as router:
        prompts = [list(range(5 + i, 45 + i)) for i in range(4)]
        outputs = [
            httpx.post(
                f"{router.url}/v1/completions",
                json=greedy_body(model, prompt, MAX_TOKENS),
                timeout=60,
            ).json()["choices"][0]["token_ids"]
            for prompt in prompts
        ]
        assert outputs == hf_greedy(Path(model), prompts, MAX_TOKENS)
        transfers = decode[0].metric("kv_transfers_total")
        assert transfers >= len(prompts)
    for server in prefill + decode:
        server.wait_pool_full()
