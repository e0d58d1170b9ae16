"""The proxy's view of its instances: a refused connection is a dead peer, a late answer is load.

Real sockets: a port nobody listens on, and a server that accepts and never answers (an instance
whose event loop is saturated)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from pdserve.proxy import app as proxy
from pdserve.proxy import instances as proxy_instances


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def _silent_server() -> AsyncIterator[str]:
    """Accepts connections and reads requests, answers nothing."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read(1 << 16)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for writer in held:
            writer.close()
        server.close()


@asynccontextmanager
async def _proxy_client(
    prefill: str, decode: str, **kwargs: bool
) -> AsyncIterator[httpx.AsyncClient]:
    """The proxy app in this process (no lifespan: no background health checks)."""
    app = proxy.build_proxy_app([prefill], [decode], timeout_s=0.3, **kwargs)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        yield client


def _instance(address: str) -> proxy_instances.Instance:
    return proxy_instances.Instance(
        "decode", f"http://{address}", httpx.AsyncClient(base_url=f"http://{address}")
    )


@pytest.fixture(autouse=True)
def quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_instances, "_HEALTH_INTERVAL_S", 0.2)


def test_refused_health_check_marks_down_at_once() -> None:
    async def run() -> None:
        instance = _instance(f"127.0.0.1:{_free_port()}")
        await instance.check()
        assert not instance.healthy
        assert instance.last_error and instance.last_error.startswith("ConnectError")

    asyncio.run(run())


def test_late_health_checks_mark_down_only_in_a_row() -> None:
    async def run() -> None:
        async with _silent_server() as address:
            instance = _instance(address)
            for _ in range(proxy_instances._LATE_CHECKS_TOLERATED):
                await instance.check()
                assert instance.healthy, "a late answer alone is load, not a dead instance"
            await instance.check()
            assert not instance.healthy
            assert "ReadTimeout on /health 3 times in a row" in (instance.last_error or "")

    asyncio.run(run())


def test_a_hop_that_times_out_fails_its_request_and_leaves_the_instance_up() -> None:
    async def run() -> None:
        async with _silent_server() as address:
            async with _proxy_client(address, address) as client:
                resp = await client.post("/v1/completions", json={"prompt": "hi"})
                assert resp.status_code == 503
                assert "ReadTimeout" in resp.json()["error"]["message"]
                health = (await client.get("/health")).json()
                assert health["prefill"][0]["healthy"], health

    asyncio.run(run())


def test_a_refused_prefill_hop_marks_it_down_and_strict_pd_names_why() -> None:
    async def run() -> None:
        address = f"127.0.0.1:{_free_port()}"
        async with _proxy_client(address, address, strict_pd=True) as client:
            resp = await client.post("/v1/completions", json={"prompt": "hi"})
            assert resp.status_code == 503
            message = resp.json()["error"]["message"]
            assert "(prefill-failed: " in message and "ConnectError" in message, message
            assert "--strict-pd" in message
            health = await client.get("/health")
            assert health.status_code == 503
            assert not health.json()["prefill"][0]["healthy"]
            again = await client.post("/v1/completions", json={"prompt": "hi"})
            assert (
                "(prefill-unavailable: No healthy prefill instance"
                in again.json()["error"]["message"]
            )
            metrics = (await client.get("/metrics")).text
            for reason in ("prefill-failed", "prefill-unavailable"):
                line = f'pdserve:proxy_requests_total{{path="local",reason="{reason}"}} 1.0'
                assert line in metrics, metrics

    asyncio.run(run())


def test_without_strict_pd_the_decode_instance_is_asked_to_prefill() -> None:
    async def run() -> None:
        address = f"127.0.0.1:{_free_port()}"
        async with _proxy_client(address, address) as client:
            resp = await client.post("/v1/completions", json={"prompt": "hi"})
            # Nobody listens there either: the fallback reached the decode instance.
            assert resp.status_code == 503
            assert "The decode instance" in resp.json()["error"]["message"]

    asyncio.run(run())


@asynccontextmanager
async def _answering_server(body: bytes, header: bytes = b"") -> AsyncIterator[str]:
    """Answers every request 200 with the JSON `body` and a `header` line (an instance whose
    answers no pdserve instance gives, or only after a fault)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + header
            + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


# kv_transfer_params a decode instance can read with.
READABLE = (
    '{"do_remote_prefill": true, "remote_engine_id": "p", "remote_request_id": "r", '
    '"remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 1, '
    '"first_token_id": 5}'
)


def _hop_answer(params: str) -> bytes:
    """A prefill instance's one-token answer with these kv_transfer_params."""
    return (
        '{"id": "cmpl-r", "choices": [{"index": 0, "text": "a", "token_ids": [5], '
        f'"finish_reason": "length"}}], "kv_transfer_params": {params}}}'
    ).encode()


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ('{"do_remote_prefill": true, "remote_port": "x"}', "kv_transfer_params.remote_port"),
        ('{"do_remote_prefill": true, "remote_engine_id": "p"}', "without remote_block_ids"),
    ],
)
def test_kv_transfer_params_a_read_cannot_use_are_a_named_fallback(params: str, named: str) -> None:
    async def run() -> None:
        async with _answering_server(_hop_answer(params)) as prefill:
            decode = f"127.0.0.1:{_free_port()}"
            async with _proxy_client(prefill, decode, strict_pd=True) as client:
                resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
                assert resp.status_code == 503
                message = resp.json()["error"]["message"]
                assert "(bad-kv-transfer-params: " in message and named in message, message
                metrics = (await client.get("/metrics")).text
                line = (
                    'pdserve:proxy_requests_total{path="local",reason="bad-kv-transfer-params"} 1.0'
                )
                assert line in metrics, metrics

    asyncio.run(run())


def test_a_decode_instance_that_recomputed_is_a_local_path_in_header_and_counter() -> None:
    """A decode instance whose load failed (kv_load_failure_policy=recompute) says so in its
    X-PD-Path; the proxy's response and counter say local, kv-load-failed, not remote."""

    async def run() -> None:
        hop = _hop_answer(READABLE)
        answer = b'{"choices": [{"index": 0, "text": "abc", "finish_reason": "length"}]}'
        recomputed = b"x-pd-path: local; reason=kv-load-failed\r\n"
        async with _answering_server(hop) as prefill, _answering_server(answer, recomputed) as d:
            async with _proxy_client(prefill, d) as client:
                resp = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "abc"
                assert resp.headers["X-PD-Path"] == "local; reason=kv-load-failed"
                metrics = (await client.get("/metrics")).text
                line = 'pdserve:proxy_requests_total{path="local",reason="kv-load-failed"} 1.0'
                assert line in metrics, metrics
                assert 'path="remote"' not in metrics, metrics

    asyncio.run(run())


def test_a_stream_whose_decode_leg_fails_after_the_first_token_ends_with_an_error() -> None:
    """The prefill instance's token went out before the decode leg began: the stream can no
    longer be a 502, so it ends with an error event naming the decode instance."""

    async def run() -> None:
        async with _answering_server(_hop_answer(READABLE)) as prefill:
            decode = f"127.0.0.1:{_free_port()}"
            async with _proxy_client(prefill, decode) as client:
                body = {"prompt": "hi", "max_tokens": 4, "stream": True}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200 and resp.headers["X-PD-Path"] == "remote"
                events = [e for e in resp.text.split("\n\n") if e]
                first, error = (json.loads(e.removeprefix("data: ")) for e in events)
                assert first["choices"][0]["text"] == "a"
                assert first["choices"][0]["finish_reason"] is None
                assert decode in error["error"]["message"], error

    asyncio.run(run())
