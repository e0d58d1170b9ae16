"""The proxy's view of its instances: a refused connection is a dead peer, a late answer is load.

Real sockets: a port nobody listens on, and a server that accepts and never answers (an instance
whose event loop is saturated)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from pdserve.entrypoints import proxy, proxy_instances


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


def _instance(address: str) -> proxy.Instance:
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
