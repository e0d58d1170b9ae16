"""Draining an instance on SIGTERM, for rolling restarts: it says so at once (/health answers
503 `{"status": "draining"}`, so proxies and routers stop sending), refuses new requests with
503 (a proxy retries them elsewhere), lets the requests in flight finish and the KV it holds
for readers be read (or its lease end), then exits. A second SIGTERM exits at once."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from pdserve.engine.async_llm import AsyncLLM
from pdserve.engine.core_client import EngineDeadError

logger = logging.getLogger(__name__)

_POLL_S = 0.1


class Drain:
    def __init__(self, engine: AsyncLLM, timeout_s: float) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.draining = False
        # Set by whoever runs the server: draining ends by telling it to exit.
        self.server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    def install(self) -> None:
        """Take SIGTERM from uvicorn (which would stop at once), in the running loop."""
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self.start)

    def start(self) -> None:
        assert self.server is not None
        if self.draining:
            logger.warning("SIGTERM while draining: exiting now")
            self.server.should_exit = True
            return
        self.draining = True
        logger.info("SIGTERM: draining (new requests get 503) before exiting")
        self._task = asyncio.get_running_loop().create_task(self._drain())

    async def idle(self) -> bool:
        """No request in flight and every block back in the pool (no KV held for a reader)."""
        if self.engine.num_in_flight:
            return False
        try:
            stats = await self.engine.refresh_stats()
        except (TimeoutError, EngineDeadError):
            return True  # nothing left to wait for
        return stats.num_free_blocks == stats.num_blocks - 1

    async def _drain(self) -> None:
        assert self.server is not None
        deadline = time.monotonic() + self.timeout_s
        while not await self.idle():
            if time.monotonic() > deadline:
                logger.warning(
                    "Drain timed out after %.0f s with %d requests in flight: exiting",
                    self.timeout_s,
                    self.engine.num_in_flight,
                )
                break
            await asyncio.sleep(_POLL_S)
        else:
            logger.info("Drained: exiting")
        self.server.should_exit = True
