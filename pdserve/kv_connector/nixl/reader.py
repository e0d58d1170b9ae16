"""The NixlConnector's READ path (decode side, pull mode), one worker rank.

A request's block runs are READ from every prefill rank it reads from, straight into the KV
cache (equal TP) or into a staging area from which this rank's heads are copied (heterogeneous
TP); the prefill side learns from the transport's notification that the bytes have left. Where
the prefill side keeps a lease board, a second READ of the lease's board slot carries that
notification: its tag proves the prefill side still held the blocks for this request after
every byte left them (docs/lease.md). With host staging the bytes land in the host buffer and
are copied into the cache before the load is reported done (staging.py).

Nothing here raises out of a step: a failed read ends its request (`failed`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from pdserve.kv_connector.nixl.handshake import client_reason
from pdserve.kv_connector.nixl.metadata import Notif, RecvReqMeta, send
from pdserve.kv_connector.nixl.staging import HostBuffer
from pdserve.kv_connector.nixl.topology import RemoteEngine, Topology
from pdserve.kv_connector.transport.base import Desc, Transport, XferState, block_descs

logger = logging.getLogger(__name__)

# How long a worker waits for its lease check (8 bytes) before leaving it to the next poll: the
# check costs one READ round trip, not one step.
_CHECK_WAIT_S = 0.002


@dataclass
class _Load:
    """The reads of one request in flight (one per remote rank it reads from): its blocks, then,
    where the prefill side keeps a lease board, the board slot of its lease (`checks`, which
    carry the `done` notification)."""

    meta: RecvReqMeta
    local_block_ids: list[int]
    handles: list[int]
    remote_tp: int
    start: float
    num_bytes: int
    num_descs: int
    engine: RemoteEngine
    done: bytes  # the encoded `done` notification
    checks: list[tuple[int, torch.Tensor]] | None = None  # (handle, where the slot lands)


class KVReader:
    def __init__(
        self,
        transport: Transport,
        topology: Topology,
        host_buffer: HostBuffer | None,
        count: Callable[[str, float], None],
    ) -> None:
        self.transport = transport
        self.topology = topology
        self.host_buffer = host_buffer
        self.count = count  # the worker's counters
        self._loads: dict[str, _Load] = {}
        # Where the board slots read land: remote ranks -> (region, tensor).
        self._checks: dict[int, tuple[int, torch.Tensor]] = {}
        self.done: set[str] = set()
        self.failed: dict[str, tuple[list[int], str]] = {}  # request -> (its blocks, why)

    def read(self, req_id: str, meta: RecvReqMeta, engine: RemoteEngine, report: bool) -> None:
        """Start the request's reads; raises if they cannot start. `report`: the request waits
        for its blocks (not a decline)."""
        local = meta.local_block_ids
        notif = Notif(
            "done", [meta.remote_request_id], self.topology.readers_per_remote_rank(engine.tp_size)
        )
        # The ranks read come first; the others (all, for a full local prefix hit or an abort;
        # the replicas of a latent cache) only need to free.
        read = [a for j, a in enumerate(engine.agents) if local and self.topology.reads_from(j)]
        for agent, _ in engine.agents[len(read) :]:
            if not send(self.transport, agent, notif):
                self.count("failed_notifications", 1.0)
        if not read:
            if report:
                self.done.add(req_id)
            return
        engine = RemoteEngine(engine.engine_id, engine.tp_size, read, engine.epoch)
        if len(meta.remote_block_ids) < len(local):
            raise ValueError(
                f"{len(local)} local blocks to fill but the prefill side has "
                f"{len(meta.remote_block_ids)}"
            )
        # The local prefix hit covers the first blocks: read the last ones.
        remote = meta.remote_block_ids[len(meta.remote_block_ids) - len(local) :]
        done = msgspec.msgpack.encode(notif)
        # Where the lease is checked after the data, the check's READ carries the `done`: the
        # prefill side must not end the lease (and clear its slot) before the check read it.
        checked = meta.remote_lease[1] != 0 and all(m.board_region >= 0 for _, m in engine.agents)
        encoded = (
            msgspec.msgpack.encode(Notif("heartbeat", [meta.remote_request_id]))
            if checked
            else done
        )
        # Started before posting: the NIXL backend may copy inside read() itself.
        start = time.perf_counter()
        handles, num_bytes, num_descs = [], 0, 0
        # Staged, the bytes land in the host buffer's blocks first.
        dest = meta.staging_block_ids or local
        for j, (agent, remote_meta) in enumerate(engine.agents):
            region, targets = self.topology.read_target(
                dest, j, engine.tp_size, remote_meta.block_len
            )
            local_descs, remote_descs = block_descs(
                region, targets, 0, remote, remote_meta.block_len
            )
            handles.append(self.transport.read(agent, local_descs, remote_descs, encoded))
            num_bytes += sum(d.length for d in local_descs)
            num_descs += len(local_descs)
        self._loads[req_id] = _Load(
            meta,
            local,
            handles,
            engine.tp_size,
            start,
            num_bytes,
            num_descs,
            engine,
            done,
            None if checked else [],
        )

    def _fail(self, req_id: str, load: _Load, reason: str) -> None:
        del self._loads[req_id]
        self.failed[req_id] = (load.local_block_ids, reason)

    def poll(self) -> None:
        for req_id, load in list(self._loads.items()):
            states = [self.transport.check_state(h) for h in load.handles]
            if XferState.PENDING in states and not load.checks:
                continue
            if XferState.PENDING in states:
                # A check reads 8 bytes: wait for it a moment rather than a step.
                deadline = time.perf_counter() + _CHECK_WAIT_S
                while XferState.PENDING in states and time.perf_counter() < deadline:
                    states = [self.transport.check_state(h) for h in load.handles]
                if XferState.PENDING in states:
                    continue
            for handle in load.handles:
                self.transport.release(handle)
            if XferState.ERROR in states:
                logger.error(
                    "KV load of request %s from engine %s failed.",
                    req_id,
                    load.meta.remote_engine_id,
                )
                self._fail(
                    req_id,
                    load,
                    f"the KV read from prefill engine {load.meta.remote_engine_id} failed in "
                    "the transport",
                )
                continue
            if load.checks is None:
                self._check_lease(req_id, load)
                continue
            slot, tag = load.meta.remote_lease
            if any(int(seen) != tag for seen in load.checks):
                logger.error(
                    "KV load of request %s from engine %s: its lease there had ended when the "
                    "read was checked (slot %d no longer holds its tag); the blocks read may "
                    "hold another request's KV.",
                    req_id,
                    load.meta.remote_engine_id,
                    slot,
                )
                self._fail(
                    req_id,
                    load,
                    f"prefill engine {load.meta.remote_engine_id} released this request's KV "
                    "blocks (its lease there ended) before the read was checked",
                )
                continue
            del self._loads[req_id]
            if load.meta.staging_block_ids:
                assert self.host_buffer is not None
                self.host_buffer.load(load.meta.staging_block_ids, load.local_block_ids)
            self.topology.finish(load.local_block_ids, load.remote_tp)
            self.done.add(req_id)
            self.count("transfers", 1.0)
            self.count("transfer_seconds", time.perf_counter() - load.start)
            self.count("transfer_bytes", load.num_bytes)
            self.count("transfer_descriptors", load.num_descs)

    def _check_lease(self, req_id: str, load: _Load) -> None:
        """The data is in place: READ the lease's board slot from every remote rank read (with
        the `done` notification)."""
        agents = load.engine.agents
        region, area = self._check_area(len(agents))
        slot, _ = load.meta.remote_lease
        handles, checks = [], []
        try:
            for j, (agent, remote_meta) in enumerate(agents):
                # Loads in flight hold distinct blocks: the first one names a free entry.
                i = j * self.topology.num_blocks + load.local_block_ids[0]
                area[i] = 0
                checks.append(area[i : i + 1])
                handles.append(
                    self.transport.read(
                        agent,
                        [Desc(region, i * 8, 8)],
                        [Desc(remote_meta.board_region, slot * 8, 8)],
                        load.done,
                    )
                )
        except Exception as e:  # a slot outside the board, a vanished agent
            logger.error("KV load of request %s: the lease check failed to start: %s", req_id, e)
            for handle in handles:
                self.transport.release(handle)
            self._fail(
                req_id,
                load,
                f"the lease check with prefill engine {load.meta.remote_engine_id} failed to "
                f"start: {client_reason(e)}",
            )
            return
        load.handles, load.checks = handles, checks

    def _check_area(self, num_ranks: int) -> tuple[int, torch.Tensor]:
        """Where the board slots of reads from `num_ranks` remote ranks land, by local block."""
        if num_ranks not in self._checks:
            area = torch.zeros(num_ranks * self.topology.num_blocks, dtype=torch.int64)
            self._checks[num_ranks] = (self.transport.register_region(area), area)
        return self._checks[num_ranks]
