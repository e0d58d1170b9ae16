"""The proxy's instances: a round-robin pool per role, health checks, and what a failed hop
says. A refused or dropped connection is a dead instance; a timeout is load (docs/proxy.md)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.protocol.errors import OpenAIError

logger = logging.getLogger(__name__)

_HEALTH_INTERVAL_S = 2.0
# Health checks in a row that may time out before an instance is marked down: a loaded instance
# answers late (or its accept queue overflows under a burst and the kernel drops SYNs, retried
# after 1 s and 3 s), which is not a dead one.
_LATE_CHECKS_TOLERATED = 2
# Above the kernel's SYN retries (1 s, 3 s, 7 s) so that a burst of new connections to an
# instance whose accept queue is full waits instead of failing.
_CONNECT_TIMEOUT_S = 30.0


@dataclass
class Instance:
    role: str
    url: str
    client: httpx.AsyncClient
    healthy: bool = True
    last_error: str | None = None
    late_checks: int = 0
    # Hops sent and not yet answered in full (a stream counts until it ends): its load.
    in_flight: int = 0
    # Push mode: where its KV side channel answers (proxy_push_leg.SideChannel), once asked.
    side_channel: Any = None

    async def check(self) -> None:
        try:
            resp = await self.client.get("/health", timeout=_HEALTH_INTERVAL_S)
            ok, why = resp.status_code == 200, f"/health answered {resp.status_code}"
            self.late_checks = 0
        except httpx.TimeoutException as e:
            self.late_checks += 1
            why = f"{type(e).__name__} on /health {self.late_checks} times in a row"
            ok = self.healthy and self.late_checks <= _LATE_CHECKS_TOLERATED
        except httpx.HTTPError as e:
            ok, why, self.late_checks = False, f"{type(e).__name__}: {e}", 0
        if ok != self.healthy:
            self.side_channel = None  # back up, maybe restarted: another engine id
            logger.warning(
                "%s instance %s is %s%s",
                self.role,
                self.url,
                "back" if ok else "down",
                "" if ok else f" ({why})",
            )
        self.healthy, self.last_error = ok, None if ok else why


class InstancePool:
    def __init__(self, role: str, addresses: list[str], timeout_s: float) -> None:
        if not addresses:
            raise ValueError(f"at least one {role} instance (--{role} HOST:PORT) is needed")
        timeout = httpx.Timeout(timeout_s, connect=_CONNECT_TIMEOUT_S)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.instances = [
            Instance(
                role,
                f"http://{a}",
                httpx.AsyncClient(base_url=f"http://{a}", timeout=timeout, limits=limits),
            )
            for a in addresses
        ]
        self.role = role
        self._next = itertools.count()

    def pick(self, among: list[Instance] | None = None) -> Instance:
        """The next healthy instance in turn, of `among` when given (a subset of the pool)."""
        instances = self.instances if not among else among
        n = len(instances)
        start = next(self._next)
        for i in range(n):
            instance = instances[(start + i) % n]
            if instance.healthy:
                return instance
        raise OpenAIError(
            503,
            f"No healthy {self.role} instance: "
            + "; ".join(f"{i.url}: {i.last_error}" for i in self.instances),
        )

    def status(self) -> list[dict[str, Any]]:
        return [{"url": i.url, "healthy": i.healthy, "error": i.last_error} for i in self.instances]

    async def close(self) -> None:
        for instance in self.instances:
            await instance.client.aclose()


def failed(instance: Instance, e: Exception) -> str:
    """Why a hop to `instance` failed. A peer that refuses or drops the connection is marked down
    until its health check passes again; one that only timed out is left to the health checks,
    and an error the proxy raised itself, building or sending the request, says nothing of it."""
    why = f"{type(e).__name__}: {e}"
    if isinstance(e, (httpx.NetworkError, httpx.RemoteProtocolError)):
        instance.healthy, instance.last_error = False, why
    return f"The {instance.role} instance {instance.url} failed: {why}"


def upstream_error(instance: Instance, e: Exception) -> OpenAIError:
    return OpenAIError(503, failed(instance, e))


def forwarded_error(instance: Instance, resp: httpx.Response) -> OpenAIError:
    param = None
    try:
        error = resp.json()["error"]
        message, param = error["message"], error.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message = resp.text[:500]
    # A client's mistake stays the client's (with the field it names); anything else is the
    # upstream's failure.
    if resp.status_code >= 500:
        return OpenAIError(502, f"{instance.role} instance {instance.url}: {message}")
    return OpenAIError(
        resp.status_code, f"{instance.role} instance {instance.url}: {message}", param=param
    )


async def check_forever(pools: list[InstancePool]) -> None:
    """Every instance's /health, every _HEALTH_INTERVAL_S, until cancelled."""
    while True:
        await asyncio.gather(*(i.check() for p in pools for i in p.instances))
        await asyncio.sleep(_HEALTH_INTERVAL_S)
