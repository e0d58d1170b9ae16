"""A decode worker rank's handshakes: the prefill engines it knows, and those it is learning,
each in a background thread (a handshake blocks on its peer, a step must not)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pdserve.kv_connector.nixl.handshake import HandshakeError, fetch_agent_metadata
from pdserve.kv_connector.nixl.metadata import AgentMetadata, RemoteAddress
from pdserve.kv_connector.nixl.topology import RemoteEngine, Topology
from pdserve.kv_connector.transport.base import Transport, memory_kind

logger = logging.getLogger(__name__)


class Handshaker:
    def __init__(
        self,
        transport: Transport,
        transport_name: str,
        topology: Topology,
        region: torch.Tensor,
        expected: dict[str, str | int] | None,
        timeout: float,
        lease_duration: float,
        count: Callable[[str], None],
    ) -> None:
        self.transport = transport
        self.transport_name = transport_name
        self.topology = topology
        self.region = region
        self.expected = expected  # the compatibility factors peers must match, if enforced
        self.timeout = timeout
        self.lease_duration = lease_duration
        self.count = count
        self.engines: dict[str, RemoteEngine] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-handshake")
        self._under_way: dict[str, Future[RemoteEngine]] = {}
        self._prepared: dict[str, float] = {}  # engine -> when heartbeats asked for it

    def start(self, engine_id: str, address: RemoteAddress) -> None:
        if engine_id not in self._under_way:
            self._under_way[engine_id] = self._pool.submit(self._handshake, engine_id, address)

    def prepare(self, engine_id: str, address: RemoteAddress) -> None:
        """Handshake with an engine that requests queued here wait for, so that their heartbeats
        reach it before their reads; at most once per lease duration."""
        last = self._prepared.get(engine_id)
        if engine_id in self._under_way or (
            last is not None and time.monotonic() - last < self.lease_duration
        ):
            return
        self._prepared[engine_id] = time.monotonic()
        self.start(engine_id, address)

    def finished(self) -> dict[str, Exception]:
        """Handshakes ended since the last call: the engines learnt join `engines`; the failed
        ones are returned with why."""
        failed = {}
        for engine_id, future in list(self._under_way.items()):
            if not future.done():
                continue
            del self._under_way[engine_id]
            try:
                self.engines[engine_id] = future.result()
            except Exception as e:  # HandshakeError, an incompatible layout, a transport error
                logger.error("KV handshake with engine %s failed: %s", engine_id, e)
                self.count("handshake_failures")
                failed[engine_id] = e
        return failed

    def _handshake(self, engine_id: str, address: RemoteAddress) -> RemoteEngine:
        agents = []
        for rank in self.topology.remote_ranks(address.tp_size):
            remote = fetch_agent_metadata(
                address.host, address.port, rank, self.expected, engine_id, self.timeout
            )
            self._check_memory(remote)
            self.topology.check_compatible(remote, address.tp_size)
            agents.append((self.transport.add_remote_agent(remote.agent_metadata), remote))
        return RemoteEngine(engine_id, address.tp_size, agents, agents[0][1].epoch)

    def _check_memory(self, remote: AgentMetadata) -> None:
        obstacle = self.transport.read_obstacle(remote.memory)
        if obstacle is not None:
            raise HandshakeError(
                f"engine {remote.engine_id} rank {remote.tp_rank}",
                f"its KV memory is {remote.memory}, this instance's is "
                f"{memory_kind(self.region)}, and the {self.transport_name} transport here "
                f"cannot read {remote.memory} memory ({obstacle})",
            )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
