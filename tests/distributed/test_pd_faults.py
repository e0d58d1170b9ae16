"""Faults of a split deployment: each ends with a terminal state and every block pool full.

One prefill and one decode instance serve the module, each with a fault plan
(tests/utils/faults.py) that a test sets and clears: it holds a READ open, drops heartbeats or
observes them, fails or corrupts a transfer, at a named point and without timers. Process
death keeps its real SIGKILL, on instances of its own, as do a model mismatch and the recompute
policy (instance settings). Liveness bounds are the clients' timeouts, never assertions.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from pdserve.utils import get_open_port
from tests.utils.faults import FaultPlan, rule, without_faults
from tests.utils.pd import (
    greedy_body,
    post_and_hang_up_later,
    prefill,
    split_request,
    start_instance,
)
from tests.utils.server import RemoteServer, sigkill, start_together

LEASE = 3  # seconds: heartbeats every 0.5 s
P_BLOCKS, D_BLOCKS = 40, 32  # small pools: a test can fill one, or make a request queue


def _prompt(mult: int, n: int) -> list[int]:
    return [(i * mult) % 500 + 3 for i in range(n)]


SHORT = list(range(5, 60))
LONG = list(range(5, 200))
# 16 blocks each: on the decode side one of them and the other do not fit at once.
QUEUED_FIRST, QUEUED_SECOND = _prompt(7, 256), _prompt(11, 256)
EXPIRED = _prompt(13, 256)
# 38 of the prefill side's 39 usable blocks: it takes EXPIRED's freed blocks.
FILLER = _prompt(17, 600)
CORRUPTED = _prompt(19, 100)


def _decode(d: RemoteServer, body: dict[str, Any], params: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{d.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=120
    )


def _tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


class Pair:
    def __init__(self, model: str, folder: Path) -> None:
        self.model = model
        self.p_plan, self.d_plan = FaultPlan(folder / "p"), FaultPlan(folder / "d")
        self.p, self.d = start_together(
            lambda: start_instance(
                model,
                "kv_producer",
                extra_args=["--num-gpu-blocks-override", str(P_BLOCKS)],
                env=self.p_plan.env,
                kv_lease_duration=LEASE,
            ),
            lambda: start_instance(
                model,
                "kv_consumer",
                extra_args=["--num-gpu-blocks-override", str(D_BLOCKS)],
                env=self.d_plan.env,
                handshake_timeout=2,
                transfer_timeout=3,
            ),
        )

    def body(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        return greedy_body(self.model, prompt, max_tokens)


@pytest.fixture(scope="module")
def pair(
    tiny_model: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    pair = Pair(tiny_model("llama"), tmp_path_factory.mktemp("faults"))
    try:
        yield pair
    finally:
        assert pair.p.stop() == [] and pair.d.stop() == []


@pytest.fixture
def faults(pair: Pair) -> Iterator[Pair]:
    yield from without_faults(pair)


def test_lease_expires_when_no_decode_reads(faults: Pair) -> None:
    """The decode instance died after the prefill finished: nobody reads, the lease frees."""
    p = faults.p
    expired = p.metric("kv_expired_leases_total")
    prefill(p, faults.body(SHORT))
    assert p.metric("kv_cache_free_blocks") < p.metric("kv_cache_total_blocks") - 1, "held"
    p.wait_pool_full(timeout=30)
    assert p.metric("kv_expired_leases_total") == expired + 1
    assert "lease expired" in p.read_log()


def _until(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        time.sleep(0.05)


def test_abort_while_waiting_for_remote_kvs_frees_both(faults: Pair) -> None:
    """The client goes away while its request waits for the READ of its KV (held open by the
    plan): the decode side keeps the blocks the READ will write until it ends, then frees them;
    the READ's `done` frees the prefill side (heartbeats held its lease meanwhile)."""
    p, d = faults.p, faults.d
    params = prefill(p, faults.body(LONG))
    faults.d_plan.set(rule("hold", "read", "delay", contains=params["remote_request_id"]))
    aborts = d.metric("request_success_total", finished_reason="abort")
    expired = p.metric("kv_expired_leases_total")
    sock = post_and_hang_up_later(d, {**faults.body(LONG, 500), "kv_transfer_params": params})
    try:
        faults.d_plan.wait_fired("hold")
        # Its READ is ordered: the request is parked in WAITING_FOR_REMOTE_KVS, with blocks.
        assert (d.metric("num_requests_running"), d.metric("num_requests_waiting")) == (0, 1)
        assert d.metric("kv_cache_free_blocks") < d.metric("kv_cache_total_blocks") - 1
    finally:
        sock.close()
    _until(
        lambda: d.metric("request_success_total", finished_reason="abort") == aborts + 1, "abort"
    )
    # Aborted, but the READ may still write into its blocks: they stay held.
    assert d.metric("num_requests_waiting") == 0
    assert d.metric("kv_cache_free_blocks") < d.metric("kv_cache_total_blocks") - 1
    faults.d_plan.release("hold")
    d.wait_pool_full()
    p.wait_pool_full()
    assert p.metric("kv_expired_leases_total") == expired


def test_decode_request_queued_past_the_lease_keeps_the_prefill_blocks(
    faults: Pair,
    reference: Callable[[list[int], int], list[int]],
    background: ThreadPoolExecutor,
) -> None:
    """pd_lessons 3: a decode request that waits for admission (no room: the first request's
    READ is held open) longer than the prefill side's lease heart-beats from its arrival, so
    the prefill side keeps its blocks: none expires, and both outputs are HF's."""
    p, d = faults.p, faults.d
    first = prefill(p, faults.body(QUEUED_FIRST))
    second = prefill(p, faults.body(QUEUED_SECOND))
    expired = p.metric("kv_expired_leases_total")
    faults.d_plan.set(rule("hold", "read", "delay", contains=first["remote_request_id"]))
    faults.p_plan.set(
        rule("beat", "recv_notif", "pass", contains=second["remote_request_id"], count=0)
    )
    done_first = background.submit(_decode, d, faults.body(QUEUED_FIRST, 4), first)
    faults.d_plan.wait_fired("hold")
    done_second = background.submit(_decode, d, faults.body(QUEUED_SECOND), second)
    _until(lambda: d.metric("num_requests_waiting") == 2, "the second request queued")
    # Heartbeats come at least a sixth of a lease apart: seven intervals outlast the lease the
    # second request's blocks had when it arrived.
    faults.p_plan.wait_fired("beat", 8)
    assert d.metric("num_requests_waiting") == 2, "the second request was admitted"
    assert p.metric("kv_expired_leases_total") == expired
    faults.d_plan.release("hold")
    assert _tokens(done_first.result()) == reference(QUEUED_FIRST, 4)
    assert _tokens(done_second.result()) == reference(QUEUED_SECOND, 8)
    p.wait_pool_full()
    assert p.metric("kv_expired_leases_total") == expired


def test_read_after_the_lease_expired_fails(faults: Pair, background: ThreadPoolExecutor) -> None:
    """pd_lessons 9: the prefill side hears no heartbeat (dropped) and the READ is held past
    the lease; the blocks are freed and filled with another prompt's KV. The late READ then
    fails (policy fail: HTTP 500) instead of decoding from another request's KV."""
    p, d = faults.p, faults.d
    params = prefill(p, faults.body(EXPIRED))
    remote_id = params["remote_request_id"]
    expired = p.metric("kv_expired_leases_total")
    failed = d.metric("kv_failed_transfers_total")
    faults.p_plan.set(rule("deaf", "recv_notif", "drop", contains=remote_id, count=0))
    faults.d_plan.set(rule("hold", "read", "delay", contains=remote_id))
    late = background.submit(_decode, d, faults.body(EXPIRED), params)
    faults.d_plan.wait_fired("hold")
    _until(lambda: p.metric("kv_expired_leases_total") == expired + 1, "the lease expired")
    filler = httpx.post(f"{p.url}/v1/completions", json=faults.body(FILLER, 1), timeout=120)
    assert filler.status_code == 200, filler.text
    faults.d_plan.release("hold")
    resp = late.result()
    assert resp.status_code == 500, resp.text
    assert "KV cache could not be loaded" in resp.json()["error"]["message"]
    assert d.metric("kv_failed_transfers_total") == failed + 1
    assert "its lease there had ended" in d.read_log()


def test_corrupted_read_is_caught_by_the_reference(
    faults: Pair, reference: Callable[[list[int], int], list[int]]
) -> None:
    """The reference comparison the split tests rely on sees flipped KV bytes (nothing in the
    transport detects them): the tokens differ from HF's."""
    p, d = faults.p, faults.d
    faults.d_plan.set(rule("flip", "transfer", "corrupt", stride=3))
    resp = split_request(p, d, faults.body(CORRUPTED))
    faults.d_plan.wait_fired("flip")
    assert _tokens(resp) != reference(CORRUPTED, 8)


def test_garbage_on_the_side_channel_is_dropped(faults: Pair) -> None:
    p, d = faults.p, faults.d
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    # Linger, so that closing right after sending does not discard the garbage unsent.
    dealer.setsockopt(zmq.LINGER, 5000)
    dealer.connect(f"tcp://127.0.0.1:{p.side_channel_port}")
    for garbage in (os.urandom(64), b"", b"\x93\x01\x02"):
        dealer.send_multipart([b"", garbage])
    dealer.close()
    with socket.create_connection(("127.0.0.1", p.side_channel_port)) as raw:
        raw.sendall(os.urandom(256))
    _until(lambda: "Dropped a malformed handshake request" in p.read_log(), "garbage logged")
    # The side channel still answers real handshakes.
    resp = split_request(p, d, faults.body(list(range(5, 40))))
    assert resp.status_code == 200, resp.text


def test_decode_rejects_before_admission_prefill_frees_at_once(faults: Pair) -> None:
    """A decode instance that refuses the request (400) tells the prefill side, which does not
    wait for its lease (pd_lessons 2)."""
    p, d = faults.p, faults.d
    expired = p.metric("kv_expired_leases_total")
    params = prefill(p, faults.body(SHORT))
    bad = {**faults.body(SHORT), "temperature": -1, "kv_transfer_params": params}
    resp = httpx.post(f"{d.url}/v1/completions", json=bad, timeout=60)
    assert resp.status_code == 400
    p.wait_pool_full()
    assert p.metric("kv_expired_leases_total") == expired


def test_model_mismatch_at_handshake(tiny_model: Callable[[str], str], faults: Pair) -> None:
    """pd_lessons 25: a prefill instance of another model is refused at the handshake, before
    any byte moves: the client gets an error at once (not a hang) that says what differs (here
    the family and the cache layout: MLA's latent against llama's keys and values), the decode
    side counts the handshake failure and logs it; the prefill side frees by its lease."""
    d = faults.d
    p = start_instance(tiny_model("deepseek_v2"), "kv_producer", kv_lease_duration=LEASE)
    try:
        failures = d.metric("kv_handshake_failures_total")
        params = prefill(p, greedy_body(tiny_model("deepseek_v2"), [5, 6, 7, 8], 8))
        resp = _decode(d, faults.body([5, 6, 7, 8]), params)
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert error["code"] == 500 and error["type"] == "InternalServerError"
        message = error["message"]
        assert "KV cache could not be loaded from the prefill instance: " in message
        assert "compatibility hash mismatch" in message
        assert "architecture: prefill DeepseekV2ForCausalLM, decode LlamaForCausalLM" in message
        assert (
            "kv_layout: prefill block-major:[blocks,layers,1,block_size,kv_heads,head_dim], "
            "decode block-major:[blocks,layers,2,block_size,kv_heads,head_dim]"
        ) in message
        assert "compatibility hash mismatch" in d.read_log()
        assert d.metric("kv_handshake_failures_total") == failures + 1
        d.wait_pool_full()
        p.wait_pool_full(timeout=30)
        assert p.metric("kv_expired_leases_total") == 1
    finally:
        assert p.stop() == []


def test_prefill_killed_before_read(
    tiny_model: Callable[[str], str],
    faults: Pair,
    reference: Callable[[list[int], int], list[int]],
) -> None:
    """The prefill instance is SIGKILLed after its prefill: the decode request fails within the
    client's timeout, and the decode side serves on."""
    d, model = faults.d, faults.model
    p = start_instance(model, "kv_producer")
    try:
        assert _tokens(split_request(p, d, faults.body(SHORT))) == reference(SHORT, 8)
        failed = d.metric("kv_failed_transfers_total")
        params = prefill(p, faults.body(LONG))
        sigkill(p)
        resp = _decode(d, faults.body(LONG), params)
        assert resp.status_code == 500, resp.text
        assert "KV cache could not be loaded" in resp.json()["error"]["message"]
        assert d.metric("kv_failed_transfers_total") == failed + 1
        ok = d.client().completions.create(model=model, prompt="still here", max_tokens=3)
        assert ok.usage.completion_tokens == 3
    finally:
        p.stop()


@pytest.mark.slow
def test_prefill_restarted_at_the_same_address_is_handshaked_again(
    tiny_model: Callable[[str], str],
    faults: Pair,
    reference: Callable[[list[int], int], list[int]],
) -> None:
    """pd_lessons 20: a prefill instance restarted at the same side channel with the same engine
    id is handshaked again on first use (its epoch changed): the first request after the
    restart is served, not read through the dead instance's agent."""
    d, model = faults.d, faults.model
    port = get_open_port()
    p = start_instance(model, "kv_producer", engine_id="restarted", side_channel_port=port)
    try:
        assert _tokens(split_request(p, d, faults.body(SHORT))) == reference(SHORT, 8)
    finally:
        sigkill(p)
        p.stop()
    p = start_instance(model, "kv_producer", engine_id="restarted", side_channel_port=port)
    try:
        assert _tokens(split_request(p, d, faults.body(LONG))) == reference(LONG, 8)
        assert "handshaking again" in d.read_log()
        p.wait_pool_full()
    finally:
        assert p.stop() == []


def test_failed_read_recomputes_to_hf_tokens(
    tiny_model: Callable[[str], str],
    faults: Pair,
    reference: Callable[[list[int], int], list[int]],
    tmp_path: Path,
) -> None:
    """kv_load_failure_policy "recompute": the decode worker's READ fails before a byte moved,
    it reports the blocks invalid, and the decode instance prefills the prompt itself: HF's
    tokens, counted as a failed transfer (the prefill side frees by its lease)."""
    p = faults.p
    plan = FaultPlan(tmp_path / "plan")
    d = start_instance(
        faults.model, "kv_consumer", env=plan.env, kv_load_failure_policy="recompute"
    )
    try:
        plan.set(rule("fail", "read", "fail"))
        resp = split_request(p, d, faults.body(LONG))
        plan.wait_fired("fail")
        assert _tokens(resp) == reference(LONG, 8)
        # Told, not silent: the proxy passes this on and counts it (tests/unit/proxy/test_health.py).
        assert resp.headers["X-PD-Path"] == "local; reason=kv-load-failed"
        assert d.metric("kv_failed_transfers_total") == 1
        assert d.metric("kv_transfers_total") == 0
        d.wait_pool_full()
    finally:
        assert d.stop() == []
