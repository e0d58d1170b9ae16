"""The front end's handle on a real EngineCore process (tiny llama)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.core_client import AsyncEngineCoreClient, EngineDeadError


@pytest.mark.timeout(60)
def test_a_send_to_a_gone_engine_fails_instead_of_blocking(
    tiny_model: Callable[[str], str],
) -> None:
    """A SIGTERM to the whole process group (systemd, `kill -- -PGID`) ends the engine beside
    its server. The server's next send, before its sentinel thread said so (the drain asking
    for the engine's numbers), had no socket to queue on and blocked the event loop for good
    (issue 27)."""
    config = EngineConfig.from_engine_args(
        model=tiny_model("llama"), dtype="float32", max_model_len=256
    )
    client = AsyncEngineCoreClient(config)
    try:

        async def run() -> None:
            client.start(lambda outputs: None, lambda reason: None)
            os.kill(client.proc.pid, signal.SIGTERM)
            # The event loop is held meanwhile, as a busy server's is: the sentinel thread's
            # word has not arrived when the send goes.
            assert wait([client.proc.sentinel], 60)
            time.sleep(0.5)  # ZMQ drops the engine's end of the socket
            with pytest.raises(EngineDeadError):
                await client.call_utility("get_stats")

        asyncio.run(run())
    finally:
        client.shutdown()
