"""The NixlConnector's real halves in one process, without a model: worker roles over KV caches
of random bytes with a real transport, and a prefill and a decode instance made of a Scheduler
beside the connector's scheduler role and one worker role. A step runs the worker half as
`Worker.execute_model` does (pre_forward, the forward, post_forward); the forward is the
test's. Handshakes go to a side channel on a free local port."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.kv_connector.nixl.scheduler import NixlConnectorScheduler
from pdserve.kv_connector.nixl.worker import NixlConnectorWorker
from pdserve.outputs import ModelRunnerOutput
from pdserve.request import Request
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.scheduler import Scheduler
from pdserve.utils import get_open_port
from tests.unit.scheduler.conftest import EOS

BLOCK_SIZE = 16
# Layers, K/V, block size, KV heads, head size of every test cache (any geometry will do: the
# connector takes it from the registered cache).
BLOCK_SHAPE = (2, 2, BLOCK_SIZE, 2, 8)


def kv_config(
    model: str,
    role: str,
    engine_id: str,
    transport: str = "nixl",
    tp: int = 1,
    connector: str = "NixlConnector",
    **extra: Any,
) -> EngineConfig:
    return EngineConfig.from_engine_args(
        model=model,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        tensor_parallel_size=tp,
        kv_transfer_config={
            "kv_connector": connector,
            "kv_role": role,
            "engine_id": engine_id,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {
                "transport": transport,
                "handshake_timeout": 10,
                **extra,
            },
        },
    )


def cache(num_blocks: int, filled: bool, num_kv_heads: int = BLOCK_SHAPE[3]) -> torch.Tensor:
    """A block-major KV cache: random bytes (a prefill side's), or zeros (a decode side's)."""
    shape = (num_blocks, *BLOCK_SHAPE[:3], num_kv_heads, BLOCK_SHAPE[4])
    return torch.randn(shape) if filled else torch.zeros(shape)


def poll(done: Callable[[], bool]) -> None:
    """Until `done()`; the test's timeout bounds the wait."""
    while not done():
        time.sleep(0.002)


class Instance:
    """A prefill (kv_producer) or decode (kv_consumer) instance: a Scheduler beside the
    connector's scheduler role, its worker role over a KV cache of `num_blocks` blocks. A
    producer serves handshakes on a free port."""

    def __init__(
        self,
        model: str,
        role: str,
        monkeypatch: pytest.MonkeyPatch,
        num_blocks: int = 64,
        transport: str = "nixl",
        use_v2: bool = False,
        push: bool = False,
        **extra: Any,
    ) -> None:
        self.engine_id = "prefill" if role == "kv_producer" else "decode"
        connector = "NixlPushConnector" if push else "NixlConnector"
        config = kv_config(model, role, self.engine_id, transport, connector=connector, **extra)
        monkeypatch.setenv("PDSERVE_SIDE_CHANNEL_PORT", str(get_open_port()))
        self.port = int(os.environ["PDSERVE_SIDE_CHANNEL_PORT"])
        self.connector = NixlConnectorScheduler(config, push=push)
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            config.model_config.max_model_len,
            num_blocks,
            use_v2,
            kv_connector=self.connector,
        )
        self.worker = NixlConnectorWorker(config, 0, push=push)
        self.cache = cache(num_blocks, filled=role == "kv_producer")
        self.worker.register_kv_caches(self.cache)
        if role == "kv_producer":
            self.connector.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})

    def execute(
        self,
        out: SchedulerOutput,
        forward: Callable[[SchedulerOutput], None] | None = None,
        eos: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> ModelRunnerOutput:
        """The worker's side of one step: one token for each request the step takes to all its
        known tokens (EOS for the ids in `eos`), and the connector's news."""
        self.worker.pre_forward(out)
        if forward is not None:
            forward(out)
        kv = self.worker.post_forward(out)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests.get(req_id)
            if request is None or request.num_computed_tokens < request.num_tokens:
                sampled.append([])
            else:
                sampled.append([EOS if req_id in eos else 7])
        return ModelRunnerOutput(req_ids, sampled, kv_connector_output=kv)

    def step(self, eos: set[str] = frozenset()) -> tuple[SchedulerOutput, list[Any]]:  # type: ignore[assignment]
        """One synchronous step: schedule, run, update."""
        out = self.scheduler.schedule()
        return out, self.scheduler.update_from_output(out, self.execute(out, eos=eos))

    def block_ids(self, request: Request) -> list[int]:
        return self.scheduler.kv_cache_manager.get_block_ids(request.request_id)

    def shutdown(self) -> None:
        self.connector.shutdown()
        self.worker.shutdown()
