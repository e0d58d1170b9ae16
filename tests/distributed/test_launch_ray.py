"""`pdserve launch --ray` on a local multi-node Ray cluster (`ray.cluster_utils.Cluster`): each
instance on a node of its own, the KV between nodes over UCX's TCP transport, and a node lost."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils.pd import complete_all, greedy_body, hf_reference
from tests.utils.procs import wait_until_gone
from tests.utils.server import MetricsReader, RemoteServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="ray is not installed (pip install 'pdserve[ray]')",
    ),
]

PROMPTS = [f"request {i}: " + " ".join(["tok"] * (i * 7)) for i in range(6)]
MAX_TOKENS = 8


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A head node with no CPUs (nothing is placed there), and one node per instance: 1 CPU for
    the TP=1 prefill instance, 2 for each TP=2 decode instance."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the launcher inherits it
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    for cpus in (1, 2, 2):
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _launch(cluster: Any, model: str, *flags: str) -> RemoteServer:
    return RemoteServer(
        [
            "launch",
            "--ray",
            "--ray-address",
            cluster.address,
            "--model",
            model,
            "--dtype",
            "float32",
            "--decode-tp",
            "2",
            "--pd-min-uncached-tokens",  # short prompts through the split too
            "0",
            *flags,
        ],
        startup_timeout=600,
    )


def _placement() -> dict[str, tuple[str, dict[str, float]]]:
    """Instance name -> (node id, bundle) of this cluster's live pdserve placement groups."""
    import ray

    placed = {}
    for group in ray.util.placement_group_table().values():
        if group["name"].startswith("pdserve-") and group["state"] == "CREATED":
            (bundle,) = group["bundles"].values()
            instance = group["name"].split("-", 2)[2]
            placed[instance] = (group["bundles_to_node_id"][0], bundle)
    return placed


def _serve_pids(model: str) -> list[int]:
    """The `pdserve serve` processes of this model (wherever Ray started them)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmdline and model.encode() in cmdline:
            found.append(int(entry))
    return found


def _complete(proxy: RemoteServer, model: str) -> list[list[int]]:
    results = asyncio.run(complete_all(proxy, model, PROMPTS, MAX_TOKENS))
    return [r.choices[0].model_extra["token_ids"] for r in results]


def _reference(model: str) -> list[list[int]]:
    return hf_reference(model, PROMPTS, MAX_TOKENS)


def _marked_down(proxy: RemoteServer, url: str) -> bool:
    return any(i["url"] == url and not i["healthy"] for i in _health(proxy)["decode"])


def _health(proxy: RemoteServer) -> dict[str, list[dict[str, Any]]]:
    return httpx.get(f"{proxy.url}/health", timeout=10).json()


def test_each_instance_on_its_node_and_a_lost_node_leaves_the_survivors_serving(
    cluster: Any, tiny_model: Callable[[str], str]
) -> None:
    import ray

    model = tiny_model("llama")
    expected = _reference(model)
    with _launch(
        cluster, model, "--decode", "2", "--transport", "ucx", "--ucx-tls", "self,tcp"
    ) as proxy:
        placed = _placement()
        assert sorted(placed) == ["decode-0", "decode-1", "prefill-0"]
        assert len({node for node, _ in placed.values()}) == 3, placed
        assert placed["decode-0"][1] == {"CPU": 2.0}, "both ranks of a TP=2 instance on one node"
        assert placed["prefill-0"][1] == {"CPU": 1.0}
        # Each instance is reached at its node's address, and its side channel listens there.
        node_ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        health = _health(proxy)
        urls = {i["url"] for role in ("prefill", "decode") for i in health[role]}
        assert {httpx.URL(u).host for u in urls} == set(node_ip.values())

        assert _complete(proxy, model) == expected
        decode = {httpx.URL(i["url"]).port: MetricsReader(i["url"]) for i in health["decode"]}
        assert all(d.metric("kv_transfers_total") > 0 for d in decode.values()), "both served"

        # decode-1's node goes away with its instance.
        lost_node = placed["decode-1"][0]
        (lost_url,) = re.findall(rf"decode-1 at (\S+) on Ray node {lost_node}", proxy.read_log())
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == lost_node))
        deadline = time.monotonic() + 60
        while not _marked_down(proxy, lost_url) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _marked_down(proxy, lost_url), "the proxy marked the lost instance down"
        assert proxy.proc.poll() is None, "the launcher serves on with the survivors"

        assert _complete(proxy, model) == expected
        for instance in _health(proxy)["prefill"] + _health(proxy)["decode"]:
            if instance["url"] != lost_url:
                MetricsReader(instance["url"]).wait_pool_full()
        assert "decode-1 was lost" in proxy.read_log()

        # A survivor's process dying is an instance death: the deployment stops.
        serve = _serve_pids(model)
        assert serve, "the surviving instances' serve processes"
        prefill = next(
            p for p in serve if b"kv_producer" in Path(f"/proc/{p}/cmdline").read_bytes()
        )
        os.kill(prefill, signal.SIGKILL)
        assert proxy.proc.wait(120) == 1
        assert "prefill-0 exited with code -9; stopping." in proxy.read_log()
        assert wait_until_gone(serve, 60) == []
        assert _placement() == {}, "the launcher removed its placement groups"


def test_push_mode_on_ray_and_ctrl_c_stops_everything(
    cluster: Any, tiny_model: Callable[[str], str]
) -> None:
    model = tiny_model("llama")
    with _launch(cluster, model, "--kv-mode", "push") as proxy:
        assert sorted(_placement()) == ["decode-0", "prefill-0"]
        assert _complete(proxy, model) == _reference(model)
        serve = _serve_pids(model)
        assert len(serve) == 2
        # Pushed, not pulled: pull mode gives the same tokens, so the tokens alone would pass
        # with --kv-mode ignored on Ray.
        for pid in serve:
            assert b"NixlPushConnector" in Path(f"/proc/{pid}/cmdline").read_bytes()
        resp = httpx.post(
            f"{proxy.url}/v1/completions",
            json=greedy_body(model, PROMPTS[-1], MAX_TOKENS),
            timeout=120,
        )
        assert resp.headers["X-PD-KV-Mode"] == "push"
        proxy.proc.send_signal(signal.SIGINT)
        assert proxy.proc.wait(120) == 0
        assert wait_until_gone(serve, 60) == []
        assert _placement() == {}


def test_an_instance_no_node_can_hold_is_refused_naming_what_it_needs(
    cluster: Any, tiny_model: Callable[[str], str]
) -> None:
    """TP=4 needs a node with 4 CPUs; the largest has 2."""
    with pytest.raises(RuntimeError) as failed:
        _launch(cluster, tiny_model("llama"), "--prefill-tp", "4", "--startup-timeout", "5")
    message = str(failed.value)
    assert "Ray could not place 1 of 2 instances within 5 s" in message
    assert "prefill-0 needs a node with {'CPU': 4.0}" in message
    assert _placement() == {}
