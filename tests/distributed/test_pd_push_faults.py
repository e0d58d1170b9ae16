"""The fault suite in push mode (NixlPushConnector): each fault ends with a terminal state on
both sides and every block pool full (pd_lessons 22, 24; docs/push.md).

One prefill and one decode push instance serve the module, each with a fault plan
(tests/utils/faults.py): a WRITE is failed or held, a registration observed. Process death
keeps its real SIGKILL, on instances of their own. The two hops are sent as the push-mode proxy
sends them: at once, the prefill hop naming a transfer id and the decode hop naming it.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.utils.faults import FaultPlan, rule, without_faults
from tests.utils.headers import check_hostile_headers
from tests.utils.pd import greedy_body, post_and_hang_up_later, split_proxy, start_instance
from tests.utils.server import RemoteServer, sigkill, start_together

# 70 s here: the default stage runs the same paths on the connector's real halves over both
# transports (tests/unit/kv_connector/test_push_lifecycle.py).
pytestmark = pytest.mark.slow

LEASE = 3  # seconds: heartbeats and PushAlive every 0.5 s
ENGINE_IDS: dict[int, str] = {}  # side-channel port -> the engine id a prefill instance got
PUSH = "NixlPushConnector"
P_BLOCKS, D_BLOCKS = 40, 32
_RNG = random.Random(0)


def fresh(n: int) -> list[int]:
    """A prompt no instance has cached: each test pushes its own (a decode-side hit would
    compute the rest there and push nothing)."""
    return [_RNG.randrange(3, 500) for _ in range(n)]


def push_prefill(model: str, **kwargs: Any) -> RemoteServer:
    engine_id = f"push-prefill-{uuid.uuid4().hex[:6]}"
    server = start_instance(model, "kv_producer", connector=PUSH, engine_id=engine_id, **kwargs)
    ENGINE_IDS[server.side_channel_port] = engine_id
    return server


class Pair:
    def __init__(self, model: str, folder: Path) -> None:
        self.model = model
        self.p_plan, self.d_plan = FaultPlan(folder / "p"), FaultPlan(folder / "d")
        self.p, self.d = start_together(
            lambda: push_prefill(
                model,
                # No logprobs on the prefill instance (the decode instance allows 20): a request
                # asking for them is one the prefill hop refuses and the decode hop accepts. One
                # request in flight: a second is a prefill hop that fails (503).
                extra_args=[
                    *("--num-gpu-blocks-override", str(P_BLOCKS), "--max-logprobs", "0"),
                    *("--max-pending-requests", "1"),
                ],
                env=self.p_plan.env,
                kv_lease_duration=LEASE,
                transfer_timeout=3,
            ),
            lambda: start_instance(
                model,
                "kv_consumer",
                extra_args=["--num-gpu-blocks-override", str(D_BLOCKS)],
                env=self.d_plan.env,
                connector=PUSH,
                handshake_timeout=2,
                transfer_timeout=3,
                kv_lease_duration=LEASE,
            ),
        )

    def body(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        return greedy_body(self.model, prompt, max_tokens)


def hops(
    p: RemoteServer, body: dict[str, Any], transfer_id: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill hop, decode hop) of one request, as the push-mode proxy builds them."""
    transfer_id = transfer_id or uuid.uuid4().hex
    prefill_hop = {
        **body,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id},
    }
    decode_hop = {
        **body,
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "remote_engine_id": ENGINE_IDS[p.side_channel_port],
            "remote_request_id": transfer_id,
            "remote_host": "127.0.0.1",
            "remote_port": p.side_channel_port,
            "tp_size": 1,
        },
    }
    return prefill_hop, decode_hop


def post(server: RemoteServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def both(
    background: ThreadPoolExecutor, p: RemoteServer, d: RemoteServer, body: dict[str, Any]
) -> tuple[Future[httpx.Response], Future[httpx.Response]]:
    prefill_hop, decode_hop = hops(p, body)
    return background.submit(post, p, prefill_hop), background.submit(post, d, decode_hop)


@pytest.fixture(scope="module")
def pair(
    tiny_model: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    pair = Pair(tiny_model("llama"), tmp_path_factory.mktemp("push_faults"))
    try:
        yield pair
    finally:
        assert pair.p.stop() == [] and pair.d.stop() == []


@pytest.fixture
def faults(pair: Pair) -> Iterator[Pair]:
    yield from without_faults(pair)


def test_both_hops_at_once_give_hf_tokens(
    faults: Pair, reference: Callable[[list[int], int], list[int]], background: ThreadPoolExecutor
) -> None:
    pushes = faults.p.metric("kv_pushes_total")
    prompt = fresh(195)
    prefill_done, decode_done = both(background, faults.p, faults.d, faults.body(prompt))
    assert tokens(decode_done.result()) == reference(prompt, 8)
    assert prefill_done.result().status_code == 200
    faults.p.wait_pool_full()
    assert faults.p.metric("kv_pushes_total") == pushes + 1


def test_hostile_headers_through_the_push_proxy(faults: Pair) -> None:
    """Issue 27 in push mode, where the prefill hop leaves in the background: a header the
    proxy cannot send on is the client's 400 before either hop, and no instance is marked
    down (the pull-mode cases: tests/distributed/test_proxy.py)."""
    with split_proxy(faults.p, faults.d, "--kv-mode", "push") as proxy:
        check_hostile_headers(proxy.url, faults.body(fresh(40), 4))
        served = httpx.post(
            f"{proxy.url}/v1/completions", json=faults.body(fresh(40), 4), timeout=60
        )
        assert served.headers["X-PD-KV-Mode"] == "push" and served.headers["X-PD-Path"] == "remote"


def test_a_prefill_hop_refused_ends_the_decode_hop_at_once(faults: Pair) -> None:
    """The push proxy sends both hops at once and the prefill instance refuses its hop: the
    client hears the prefill instance's 400, as in pull mode, and the decode hop, which waits
    for a push that will never come, ends by the proxy at once, not by its watchdog after a
    lease of silence (30 s by default) with a 502."""
    watchdogs = faults.d.metric("kv_push_watchdogs_total")
    aborts = faults.d.metric("request_success_total", finished_reason="abort")
    with split_proxy(faults.p, faults.d, "--kv-mode", "push") as proxy:
        body = {**faults.body(fresh(40), 4), "logprobs": 1}
        resp = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        assert "logprobs" in resp.json()["error"]["message"]
        assert proxy.stop() == []
    faults.d.wait_pool_full()
    assert faults.d.metric("request_success_total", finished_reason="abort") == aborts + 1
    assert faults.d.metric("kv_push_watchdogs_total") == watchdogs


def test_a_prefill_hop_failed_makes_the_path_local_at_once(
    faults: Pair, reference: Callable[[list[int], int], list[int]]
) -> None:
    """The prefill instance answers its hop 503 (busy: a stream holds its one request in
    flight): the proxy ends the decode hop, which waits for a push that will never come, at
    once, and sends the request again for the decode instance to compute, as pull mode's local
    path does, instead of a watchdog's 502 after a lease."""
    watchdogs = faults.d.metric("kv_push_watchdogs_total")
    busy = post_and_hang_up_later(faults.p, {**faults.body(fresh(8), 1000), "stream": True})
    try:
        assert busy.recv(12) == b"HTTP/1.1 200"
        with split_proxy(faults.p, faults.d, "--kv-mode", "push") as proxy:
            prompt = fresh(40)
            resp = httpx.post(
                f"{proxy.url}/v1/completions", json=faults.body(prompt, 4), timeout=60
            )
            assert tokens(resp) == reference(prompt, 4)
            assert resp.headers["X-PD-Path"] == "local; reason=prefill-failed"
            assert proxy.stop() == []
    finally:
        busy.close()
    faults.d.wait_pool_full()
    assert faults.d.metric("kv_push_watchdogs_total") == watchdogs


def test_a_registration_that_never_comes_frees_by_the_lease(faults: Pair) -> None:
    """The decode hop never arrived (its instance died first): the lease frees the blocks."""
    p = faults.p
    expired = p.metric("kv_expired_leases_total")
    prefill_hop, _ = hops(p, faults.body(fresh(55)))
    assert post(p, prefill_hop).status_code == 200
    assert p.metric("kv_cache_free_blocks") < p.metric("kv_cache_total_blocks") - 1, "held"
    p.wait_pool_full(timeout=30)
    assert p.metric("kv_expired_leases_total") == expired + 1


def test_a_failed_write_ends_both_sides(faults: Pair, background: ThreadPoolExecutor) -> None:
    """pd_lessons 22: a WRITE that fails at its post is a terminal state on both sides, not a
    decode side counting notifications forever: the client hears, both pools are full."""
    p, d = faults.p, faults.d
    failed = d.metric("kv_failed_transfers_total")
    faults.p_plan.set(rule("fail", "read", "fail", op="WRITE"))
    prefill_done, decode_done = both(background, p, d, faults.body(fresh(195)))
    resp = decode_done.result()
    assert resp.status_code == 500, resp.text
    assert "the KV write failed in the transport" in resp.json()["error"]["message"]
    assert prefill_done.result().status_code == 200
    faults.p_plan.wait_fired("fail")
    assert d.metric("kv_failed_transfers_total") == failed + 1
    assert p.metric("kv_failed_pushes_total") >= 1


def test_decode_abort_while_the_write_is_held_frees_both(
    faults: Pair, background: ThreadPoolExecutor
) -> None:
    """pd_lessons 24: the client leaves while the prefill side's WRITE into its blocks is held
    open: the decode side keeps those blocks until the prefill side said it stopped; then both
    free, and no lease expired."""
    p, d = faults.p, faults.d
    expired = p.metric("kv_expired_leases_total")
    aborts = d.metric("request_success_total", finished_reason="abort")
    faults.p_plan.set(rule("hold", "read", "delay", op="WRITE"))
    prefill_hop, decode_hop = hops(p, faults.body(fresh(195), 500))
    decode_done = background.submit(
        httpx.post, f"{d.url}/v1/completions", json=decode_hop, timeout=httpx.Timeout(2.0)
    )
    assert post(p, prefill_hop).status_code == 200
    faults.p_plan.wait_fired("hold")
    with pytest.raises(httpx.TimeoutException):
        decode_done.result()  # the client gives up: the decode request is aborted
    deadline = time.monotonic() + 60
    while d.metric("request_success_total", finished_reason="abort") < aborts + 1:
        assert time.monotonic() < deadline, "the abort never came"
        time.sleep(0.05)
    # The held WRITE may still land in its blocks: they stay.
    assert d.metric("kv_cache_free_blocks") < d.metric("kv_cache_total_blocks") - 1
    faults.p_plan.release("hold")
    d.wait_pool_full()
    p.wait_pool_full()
    assert p.metric("kv_expired_leases_total") == expired


def test_decode_rejects_before_admission_prefill_frees_at_once(
    faults: Pair, background: ThreadPoolExecutor
) -> None:
    """pd_lessons 2: a decode hop refused at validation tells the prefill side that nothing is
    needed: its blocks free when the prompt is done, not by the lease."""
    p, d = faults.p, faults.d
    expired = p.metric("kv_expired_leases_total")
    prefill_hop, decode_hop = hops(p, faults.body(fresh(55)))
    resp = post(d, {**decode_hop, "temperature": -1})
    assert resp.status_code == 400
    assert post(p, prefill_hop).status_code == 200
    p.wait_pool_full()
    assert p.metric("kv_expired_leases_total") == expired


def test_decode_requests_queued_past_the_lease_keep_the_prefill_blocks(
    faults: Pair, reference: Callable[[list[int], int], list[int]], background: ThreadPoolExecutor
) -> None:
    """pd_lessons 3 and 22: a decode request queued for admission longer than the prefill
    side's lease (the first one's write is held, its blocks fill the pool) heart-beats from its
    arrival: no lease expires, and both outputs are HF's."""
    p, d = faults.p, faults.d
    expired = p.metric("kv_expired_leases_total")
    # 16 blocks each: on the decode side one and the other do not fit at once.
    queued_first, queued_second = fresh(256), fresh(256)
    first_p, first_d = hops(p, faults.body(queued_first, 4), "first-" + uuid.uuid4().hex)
    second_p, second_d = hops(p, faults.body(queued_second), "second-" + uuid.uuid4().hex)
    second_id = second_d["kv_transfer_params"]["remote_request_id"]
    faults.p_plan.set(
        rule("hold", "read", "delay", op="WRITE", count=0),
        rule("beat", "recv_notif", "pass", contains=second_id, count=0),
    )
    done_first = background.submit(post, d, first_d)
    assert post(p, first_p).status_code == 200
    faults.p_plan.wait_fired("hold")
    done_second = background.submit(post, d, second_d)
    assert post(p, second_p).status_code == 200
    faults.p_plan.wait_fired("beat", 8)  # heartbeats over more than a lease
    assert p.metric("kv_expired_leases_total") == expired
    faults.p_plan.release("hold")
    assert tokens(done_first.result()) == reference(queued_first, 4)
    assert tokens(done_second.result()) == reference(queued_second, 8)
    assert p.metric("kv_expired_leases_total") == expired


def test_prefill_killed_while_writing_fires_the_watchdog(
    faults: Pair, background: ThreadPoolExecutor
) -> None:
    """The prefill instance is SIGKILLed while its WRITE is held: its PushAlive stops, the
    decode side's watchdog ends the request within a lease, and the decode side serves on."""
    d, model = faults.d, faults.model
    plan = FaultPlan(faults.p_plan.folder.parent / "killed")
    p = push_prefill(model, env=plan.env)
    try:
        plan.set(rule("hold", "read", "delay", op="WRITE"))
        prefill_done, decode_done = both(background, p, d, faults.body(fresh(195)))
        plan.wait_fired("hold")
        sigkill(p)
        resp = decode_done.result()
        assert resp.status_code == 500, resp.text
        assert "sent no word" in resp.json()["error"]["message"]
        ok = d.client().completions.create(model=model, prompt="still here", max_tokens=3)
        assert ok.usage.completion_tokens == 3
    finally:
        p.stop()


def test_decode_killed_after_registering_frees_the_prefill_side(
    faults: Pair, background: ThreadPoolExecutor
) -> None:
    """The decode instance is SIGKILLed once its registration arrived, the WRITE held: the
    WRITE fails against the dead peer and the prefill side frees, within its transfer timeout,
    not its lease."""
    p, model = faults.p, faults.model
    plan = FaultPlan(faults.d_plan.folder.parent / "killed-decode")
    d = start_instance(model, "kv_consumer", env=plan.env, connector=PUSH)
    try:
        expired = p.metric("kv_expired_leases_total")
        failed = p.metric("kv_failed_pushes_total")
        faults.p_plan.set(rule("hold", "read", "delay", op="WRITE"))
        prefill_hop, decode_hop = hops(p, faults.body(fresh(195)))
        background.submit(post, d, decode_hop)
        assert post(p, prefill_hop).status_code == 200
        faults.p_plan.wait_fired("hold")
        sigkill(d)
        faults.p_plan.release("hold")
        p.wait_pool_full(timeout=60)
        # Freed by the failed WRITE's Pushed, not by the lease (the WRITE in flight renewed it).
        assert p.metric("kv_failed_pushes_total") == failed + 1
        assert p.metric("kv_expired_leases_total") == expired
    finally:
        d.stop()
