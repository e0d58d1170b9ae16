"""Faults of a split deployment: each ends with a terminal state and every block pool full."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable

import httpx
import pytest
import zmq

from tests.utils.pd import prefill, split_request, start_instance
from tests.utils.server import descendants


def _body(model: str, prompt: list[int], max_tokens: int = 8) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_lease_expires_when_no_decode_reads(tiny_model: Callable[[str], str]) -> None:
    """The decode instance died after the prefill finished: nobody reads, the lease frees."""
    model = tiny_model("llama")
    p = start_instance(model, "kv_producer", kv_lease_duration=2)
    try:
        prefill(p, _body(model, list(range(5, 60))))
        assert p.metric("kv_cache_free_blocks") < p.metric("kv_cache_total_blocks") - 1, (
            "blocks held"
        )
        p.wait_pool_full(timeout=15)
        assert p.metric("kv_expired_leases_total") == 1
        assert "lease expired" in p.read_log()
    finally:
        assert p.stop() == []


def test_prefill_killed_before_read(tiny_model: Callable[[str], str]) -> None:
    model = tiny_model("llama")
    p = start_instance(model, "kv_producer")
    d = start_instance(model, "kv_consumer", handshake_timeout=2, transfer_timeout=3)
    try:
        params = prefill(p, _body(model, list(range(5, 60))))
        for pid in [p.proc.pid, *descendants(p.proc.pid)]:
            os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        resp = httpx.post(
            f"{d.url}/v1/completions",
            json={**_body(model, list(range(5, 60))), "kv_transfer_params": params},
            timeout=60,
        )
        assert time.monotonic() - start < 15
        assert resp.status_code == 500, resp.text
        assert "KV cache could not be loaded" in resp.json()["error"]["message"]
        assert d.metric("kv_failed_transfers_total") == 1
        assert "failed" in d.read_log()
        # The decode instance keeps serving.
        ok = d.client().completions.create(model=model, prompt="still here", max_tokens=3)
        assert ok.usage.completion_tokens == 3
        d.wait_pool_full()
    finally:
        p.stop()
        assert d.stop() == []


def test_model_mismatch_at_handshake(tiny_model: Callable[[str], str]) -> None:
    p = start_instance(tiny_model("qwen2"), "kv_producer")
    d = start_instance(tiny_model("llama"), "kv_consumer")
    try:
        params = prefill(p, _body(tiny_model("qwen2"), [5, 6, 7, 8]))
        resp = httpx.post(
            f"{d.url}/v1/completions",
            json={**_body(tiny_model("llama"), [5, 6, 7, 8]), "kv_transfer_params": params},
            timeout=60,
        )
        assert resp.status_code == 500
        assert "compatibility hash mismatch" in d.read_log()
        assert d.metric("kv_handshake_failures_total") == 1
        d.wait_pool_full()
        # Nobody read: the prefill side frees by its lease (30 s by default) - not waited for here.
    finally:
        assert p.stop() == [] and d.stop() == []


def test_abort_while_waiting_for_remote_kvs_frees_both(tiny_model: Callable[[str], str]) -> None:
    model = tiny_model("llama")
    p = start_instance(model, "kv_producer", kv_lease_duration=120)
    d = start_instance(model, "kv_consumer")
    try:
        prompt = list(range(5, 200))
        params = prefill(p, _body(model, prompt))
        # The client gives up at once, while the decode side handshakes and reads.
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                f"{d.url}/v1/completions",
                json={**_body(model, prompt, 500), "kv_transfer_params": params},
                timeout=0.05,
            )
        d.wait_pool_full(timeout=30)
        # The prefill side heard from the reader and freed long before its 120 s lease.
        p.wait_pool_full(timeout=30)
        assert p.metric("kv_expired_leases_total") == 0
        assert d.metric("request_success_total", finished_reason="abort") == 1
    finally:
        assert p.stop() == [] and d.stop() == []


def test_garbage_on_the_side_channel_is_dropped(tiny_model: Callable[[str], str]) -> None:
    model = tiny_model("llama")
    p = start_instance(model, "kv_producer")
    d = start_instance(model, "kv_consumer")
    try:
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
        deadline = time.monotonic() + 20
        while "Dropped a malformed handshake request" not in p.read_log():
            assert time.monotonic() < deadline, p.read_log()
            time.sleep(0.2)
        # The side channel still answers real handshakes.
        resp = split_request(p, d, _body(model, list(range(5, 40))))
        assert resp.status_code == 200, resp.text
        for server in (p, d):
            server.wait_pool_full()
    finally:
        assert p.stop() == [] and d.stop() == []


def test_decode_rejects_before_admission_prefill_frees_at_once(
    tiny_model: Callable[[str], str],
) -> None:
    """A decode instance that refuses the request (400) tells the prefill side, which does not
    wait for its lease (pd_lessons 2)."""
    model = tiny_model("llama")
    p = start_instance(model, "kv_producer", kv_lease_duration=120)
    d = start_instance(model, "kv_consumer")
    try:
        params = prefill(p, _body(model, list(range(5, 60))))
        bad = {**_body(model, list(range(5, 60))), "temperature": -1, "kv_transfer_params": params}
        resp = httpx.post(f"{d.url}/v1/completions", json=bad, timeout=60)
        assert resp.status_code == 400
        p.wait_pool_full(timeout=30)
        assert p.metric("kv_expired_leases_total") == 0
        d.wait_pool_full()
    finally:
        assert p.stop() == [] and d.stop() == []
