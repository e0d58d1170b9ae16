"""What every request through the proxy shares: its instances, their routers, the prompt
tokenizer, the metrics, and the request ids in flight."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.proxy.instances import InstancePool, check_forever
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.prompts import PromptTokens
from pdserve.proxy.routing import Router, RoutingConfig, discover_all


class ProxyState:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout_s: float,
        strict_pd: bool,
        routing: RoutingConfig,
        model: str | None,
        kv_mode: str,
    ) -> None:
        self.pools = {
            "prefill": InstancePool("prefill", prefill, timeout_s),
            "decode": InstancePool("decode", decode, timeout_s),
        }
        self.routing = routing
        self.routers = {role: Router(pool, routing) for role, pool in self.pools.items()}
        self.prompts = PromptTokens(model)
        self.metrics = ProxyMetrics()
        self.strict_pd = strict_pd
        self.kv_mode = kv_mode
        # X-Request-Ids of the requests being served: one names both hops of its request, so a
        # second request in flight under the same id is refused before it reaches an instance.
        self.in_flight: set[str] = set()
        # Tasks that outlive their request (a push-mode prefill hop, closing a decode leg
        # nobody reads); kept referenced until they end.
        self.background: set[asyncio.Task[Any]] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def keep(self, task: asyncio.Task[Any]) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def start(self) -> None:
        """Health checks, and following the instances' KV events where routing reads them."""
        self._tasks.append(asyncio.create_task(check_forever(list(self.pools.values()))))
        if self.routing.policy == "cache_aware":
            routers = list(self.routers.values())
            self._tasks.append(asyncio.create_task(discover_all(routers, self.prompts)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for router in self.routers.values():
            router.close()
        for pool in self.pools.values():
            await pool.close()

    def health(self) -> tuple[dict[str, object], bool]:
        """/health's body, and whether the proxy can serve: without a prefill instance the
        decode instances still serve, prefilling themselves (unless --strict-pd)."""
        status = {role: router.status() for role, router in self.routers.items()}
        up = {role: any(i["healthy"] for i in s) for role, s in status.items()}
        serving = up["decode"] and (up["prefill"] or not self.strict_pd)
        return {"status": "ok" if all(up.values()) else "degraded", **status}, serving
