"""The NixlConnector's worker role: handshake, READ the prefill side's blocks, hold leases.

Decode side: a request to load is parked until its prefill engine is known (a handshake in a
background thread), then READ block runs straight into the KV cache (equal TP) or into a staging
area from which this rank's heads are copied (heterogeneous TP). The prefill side is told by the
transport's notification when the bytes have left. Prefill side: finished requests hold their
blocks under a lease (lease.py). Nothing here raises out of a step: a failure ends the one
request (its blocks reported invalid) and is counted.

With host staging the transport registers a host buffer instead of the cache: the prefill side
copies a request's blocks into it after the forward pass that completes its prompt, the decode
side READs into it and copies into the cache before it reports the load done (staging.py).

In push mode (NixlPushConnector) the decode side registers its blocks instead of reading them,
and the prefill side writes them (push.py); handshakes, leases and heartbeats are the same.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.kv_connector.nixl.handshake import HandshakeError, fetch_agent_metadata
from pdserve.kv_connector.nixl.lease import LeaseHolder
from pdserve.kv_connector.nixl.metadata import (
    AgentMetadata,
    HandshakePayload,
    NixlConnectorMetadata,
    Notif,
    PeerMessage,
    PushAlive,
    Pushed,
    PushRegistration,
    RecvReqMeta,
    RemoteAddress,
    SaveReqMeta,
    compatibility_factors,
    compatibility_hash,
)
from pdserve.kv_connector.nixl.push import PushReceiver, PushSender
from pdserve.kv_connector.nixl.staging import HostBuffer
from pdserve.kv_connector.nixl.topology import RemoteEngine, Topology
from pdserve.kv_connector.transport.base import (
    Desc,
    XferState,
    block_descs,
    make_transport,
    memory_kind,
)
from pdserve.outputs import KVConnectorOutput
from pdserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)

# How long a decode worker waits for its lease check (8 bytes) before leaving it to the next
# poll: the check costs one READ round trip, not one step.
_CHECK_WAIT_S = 0.002


def _why(e: Exception) -> str:
    """A failure as a client may be told it: handshake and layout errors say what differs and
    name no address; a transport's own error (which may) only by its type."""
    if isinstance(e, HandshakeError):
        return e.reason
    if isinstance(e, ValueError):
        return str(e)
    return f"{type(e).__name__} in the transport (this instance's log has the details)"


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


class NixlConnectorWorker:
    def __init__(self, config: EngineConfig, tp_rank: int, push: bool = False) -> None:
        kv = config.kv_transfer_config
        assert kv is not None
        self.push = push
        self.engine_id = kv.engine_id
        self.tp_rank = tp_rank
        self.tp_size = config.parallel_config.tensor_parallel_size
        self.lease_duration = kv.kv_lease_duration
        self.handshake_timeout = kv.handshake_timeout
        self.transport_name = kv.transport
        self.architecture = config.model_config.architecture
        self.enforce_handshake_compat = kv.enforce_handshake_compat
        self.host_staging = kv.uses_host_staging(config.device)
        self.host_buffer_blocks = kv.host_buffer_blocks
        self.transport = make_transport(
            kv.transport,
            f"{self.engine_id}:{tp_rank}",
            envs.side_channel_host(),
            kv.transfer_timeout,
            kv.ucx_tls,
            device_memory=kv.buffer_device(config.device) == "cuda",
        )
        self.kv_cache: torch.Tensor | None = None
        # What the transport registered and peers read: the cache, or its host buffer.
        self.region: torch.Tensor | None = None
        self.host_buffer: HostBuffer | None = None
        self._saves: dict[str, SaveReqMeta] = {}
        self.topology: Topology | None = None
        # Of the registered cache: its layout is what the peers must agree on.
        self.compat_factors: dict[str, str | int] = {}
        self.compat_hash: str | None = None
        self._meta = NixlConnectorMetadata()
        self._meta_decoder = msgspec.msgpack.Decoder(NixlConnectorMetadata)
        self._handshaker = ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-handshake")
        self._handshakes: dict[str, Future[RemoteEngine]] = {}
        self._engines: dict[str, RemoteEngine] = {}
        self._waiting: dict[str, RecvReqMeta] = {}  # for their engine's handshake
        self._loads: dict[str, _Load] = {}
        self._done_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._load_errors: dict[str, str] = {}  # request id -> why its load failed
        # Prefill side: the leases of finished requests' blocks, and the board peers check.
        self.leases = LeaseHolder(self.lease_duration)
        self._stats: dict[str, float] = {}
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.board_region = -1
        # Decode side: where the board slots it reads land.
        self._checks: dict[int, tuple[int, torch.Tensor]] = {}  # remote ranks -> region, tensor
        # Decode side: handshakes heartbeats asked for (engine -> when), requests that already
        # handshook again because their prefill instance's epoch had changed.
        self._prepared: dict[str, float] = {}
        self._rehandshaked: set[str] = set()
        # Push mode: the two sides' state (set once the cache is registered). The requests of
        # `_waiting` that decline (they ask for nothing and report nothing).
        self.sender: PushSender | None = None
        self.receiver: PushReceiver | None = None
        self._declined: set[str] = set()
        self._peer_decoder = msgspec.msgpack.Decoder(PeerMessage)

    # ---- set-up -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.compat_factors = compatibility_factors(
            self.architecture, kv_cache, self.tp_size, self.transport_name
        )
        self.compat_hash = compatibility_hash(self.compat_factors)
        region = kv_cache
        if self.host_staging:
            self.host_buffer = HostBuffer(kv_cache, self.host_buffer_blocks or kv_cache.shape[0])
            region = self.host_buffer.tensor
        self.region = region
        self.transport.register_region(region)
        # One slot per request that can hold a lease at once, as the scheduler sizes its own.
        board = self.leases.make_board(region.shape[0] + self.max_num_seqs)
        self.board_region = self.transport.register_region(board)
        self.topology = Topology(
            kv_cache, self.tp_rank, self.tp_size, self.transport, region.device
        )
        if self.push:
            self.sender = PushSender(
                self.transport, kv_cache, self.leases, self.lease_duration, self._count
            )
            self.receiver = PushReceiver(
                self.transport, self.topology, self.lease_duration, self._count
            )

    def get_handshake_metadata(self) -> bytes:
        assert self.region is not None and self.compat_hash is not None
        region = self.region
        meta = AgentMetadata(
            self.engine_id,
            self.tp_rank,
            self.tp_size,
            self.transport_name,
            self.transport.get_agent_metadata(),
            region.shape[0],
            region[0].nbytes,
            region.shape[3],
            region.shape[4],
            region.shape[5],
            region.shape[1],
            str(region.dtype).removeprefix("torch."),
            memory_kind(region),
            self.board_region,
            0 if self.leases.board is None else self.leases.board.numel(),
        )
        return msgspec.msgpack.encode(
            HandshakePayload(self.compat_hash, msgspec.msgpack.encode(meta), self.compat_factors)
        )

    # ---- each step --------------------------------------------------------------------------

    def pre_forward(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.kv_connector_metadata is not None:
            self.bind(self._meta_decoder.decode(scheduler_output.kv_connector_metadata))
        self.start_load_kv()

    def post_forward(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput | None:
        self.wait_for_save()
        sending, recving = self.get_finished()
        output = KVConnectorOutput(
            sending,
            recving,
            self.take_invalid_block_ids(),
            self.take_stats() or None,
            self.take_load_errors() or None,
        )
        return None if output.is_empty() else output

    def bind(self, meta: NixlConnectorMetadata) -> None:
        self._meta = meta

    def start_load_kv(self) -> None:
        meta, self._meta = self._meta, NixlConnectorMetadata()
        self._saves = meta.reqs_to_save
        self.leases.stamp(meta.lease_stamps)
        self.leases.hold(meta.reqs_to_send)
        self._waiting.update(meta.reqs_to_recv)
        self._waiting.update(meta.declines)
        self._declined.update(meta.declines)
        if self.sender is not None and self.receiver is not None:
            self.sender.update(meta.reqs_to_push, meta.push_aborts)
            self.receiver.cancel(meta.push_cancels)
            for req_id in meta.push_cancels:
                if req_id in self._waiting:  # not registered yet: register for nothing
                    self._waiting[req_id].local_block_ids = []
        for engine_id, remote_ids in meta.heartbeats.items():
            engine = self._engines.get(engine_id)
            if engine is not None:
                self._notify(engine, Notif("heartbeat", remote_ids))
            elif engine_id in meta.remote_engines:
                self._prepare(engine_id, meta.remote_engines[engine_id])
        self._start_loads()

    def _prepare(self, engine_id: str, address: RemoteAddress) -> None:
        """Handshake with an engine that requests queued here wait for, so that their heartbeats
        reach it before their reads; at most once per lease duration."""
        last = self._prepared.get(engine_id)
        if engine_id in self._handshakes or (
            last is not None and time.monotonic() - last < self.lease_duration
        ):
            return
        self._prepared[engine_id] = time.monotonic()
        self._handshakes[engine_id] = self._handshaker.submit(self._handshake, engine_id, address)

    def wait_for_save(self) -> None:
        """Host staging, prefill side: the step's forward pass wrote the last blocks of these
        requests' prompts; their staged copies are complete before the step's output (and with
        it the requests' kv_transfer_params) goes out."""
        saves, self._saves = self._saves, {}
        if saves:
            assert self.host_buffer is not None
            self.host_buffer.save(
                [b for save in saves.values() for b in save.block_ids],
                [b for save in saves.values() for b in save.staging_block_ids],
            )

    def _start_loads(self) -> None:
        for req_id, meta in list(self._waiting.items()):
            engine_id = meta.remote_engine_id
            engine = self._engines.get(engine_id)
            if engine is not None and meta.remote_epoch and engine.epoch != meta.remote_epoch:
                if req_id in self._rehandshaked:
                    # Handshook again and still another incarnation: its own is gone.
                    logger.error(
                        "KV load of request %s: the prefill instance of engine %s that holds its "
                        "KV (epoch %s) is gone; the one there now is epoch %s.",
                        req_id,
                        engine_id,
                        meta.remote_epoch,
                        engine.epoch,
                    )
                    del self._waiting[req_id]
                    self._rehandshaked.discard(req_id)
                    self._fail(
                        req_id,
                        meta.local_block_ids,
                        "failed_transfers",
                        f"prefill engine {engine_id} restarted (epoch {meta.remote_epoch}, now "
                        f"{engine.epoch}): the KV it held for this request is gone",
                    )
                    continue
                # The instance restarted at the same address: learn it anew before reading.
                logger.warning(
                    "Engine %s answers with epoch %s, request %s names %s: handshaking again.",
                    engine_id,
                    engine.epoch,
                    req_id,
                    meta.remote_epoch,
                )
                self._rehandshaked.add(req_id)
                del self._engines[engine_id]
                engine = None
            if engine is None:
                if engine_id not in self._handshakes:
                    address = RemoteAddress(meta.remote_host, meta.remote_port, meta.remote_tp_size)
                    self._handshakes[engine_id] = self._handshaker.submit(
                        self._handshake, engine_id, address
                    )
                continue
            del self._waiting[req_id]
            self._rehandshaked.discard(req_id)
            report = req_id not in self._declined
            self._declined.discard(req_id)
            try:
                if self.receiver is not None:
                    self.receiver.register(req_id, meta, engine, report)
                else:
                    self._read(req_id, meta, engine, report)
            except Exception as e:  # a bad descriptor, a vanished agent: this request only
                logger.error("KV load of request %s failed to start: %s", req_id, e)
                self._fail(
                    req_id,
                    meta.local_block_ids,
                    "failed_transfers",
                    f"the KV read from prefill engine {engine_id} failed to start: {_why(e)}",
                )

    def _handshake(self, engine_id: str, address: RemoteAddress) -> RemoteEngine:
        assert self.topology is not None
        ranks = self.topology.remote_ranks(address.tp_size)
        expected = self.compat_factors if self.enforce_handshake_compat else None
        agents = []
        for rank in ranks:
            remote = fetch_agent_metadata(
                address.host,
                address.port,
                rank,
                expected,
                engine_id,
                self.handshake_timeout,
            )
            self._check_memory(remote)
            self.topology.check_compatible(remote, address.tp_size)
            agents.append((self.transport.add_remote_agent(remote.agent_metadata), remote))
        return RemoteEngine(engine_id, address.tp_size, agents, agents[0][1].epoch)

    def _check_memory(self, remote: AgentMetadata) -> None:
        assert self.region is not None
        obstacle = self.transport.read_obstacle(remote.memory)
        if obstacle is not None:
            raise HandshakeError(
                f"engine {remote.engine_id} rank {remote.tp_rank}",
                f"its KV memory is {remote.memory}, this instance's is "
                f"{memory_kind(self.region)}, and the {self.transport_name} transport here "
                f"cannot read {remote.memory} memory ({obstacle})",
            )

    def _read(self, req_id: str, meta: RecvReqMeta, engine: RemoteEngine, report: bool) -> None:
        assert self.topology is not None
        local = meta.local_block_ids
        notif = Notif(
            "done", [meta.remote_request_id], self.topology.readers_per_remote_rank(engine.tp_size)
        )
        if not local:  # a full local prefix hit, or an abort: the prefill side only needs to free
            self._notify(engine, notif)
            if report:
                self._done_recving.add(req_id)
            return
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

    def _notify(self, engine: RemoteEngine, notif: Notif) -> None:
        msg = msgspec.msgpack.encode(notif)
        for agent, _ in engine.agents:
            try:
                self.transport.send_notif(agent, msg)
            except Exception as e:
                logger.warning("Notification to %s failed: %s", agent, e)
                self._count("failed_notifications")

    def _fail(self, req_id: str, block_ids: list[int], counter: str, reason: str) -> None:
        """`reason` travels to the request's client: short, and no address."""
        self._invalid_block_ids.update(block_ids)
        self._load_errors[req_id] = reason
        self._done_recving.add(req_id)
        self._count(counter)

    def _count(self, name: str, value: float = 1.0) -> None:
        self._stats[name] = self._stats.get(name, 0.0) + value

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self._finish_handshakes()
        self._poll_notifications()
        if self.sender is not None:
            self.sender.step()
        done_sending, num_expired = self.leases.take_ended()
        if num_expired:
            self._count("expired_leases", num_expired)
        self._poll_loads()
        if self.sender is not None and self.receiver is not None:
            self.sender.forget(done_sending)
            self._poll_pushes(self.receiver)
        done_recving, self._done_recving = self._done_recving, set()
        return done_sending or None, done_recving or None

    def _poll_pushes(self, receiver: PushReceiver) -> None:
        receiver.check_watchdogs()
        self._done_recving |= receiver.done
        receiver.done = set()
        for req_id, (block_ids, why) in receiver.failed.items():
            self._fail(req_id, block_ids, "failed_transfers", why)
        receiver.failed = {}

    def _finish_handshakes(self) -> None:
        for engine_id, future in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[engine_id]
            try:
                self._engines[engine_id] = future.result()
            except Exception as e:  # HandshakeError, an incompatible layout, a transport error
                logger.error("KV handshake with engine %s failed: %s", engine_id, e)
                self._count("handshake_failures")
                reason = f"the KV handshake with prefill engine {engine_id} failed: {_why(e)}"
                for req_id, meta in list(self._waiting.items()):
                    if meta.remote_engine_id == engine_id:
                        del self._waiting[req_id]
                        self._fail(req_id, meta.local_block_ids, "failed_transfers", reason)
        self._start_loads()

    def _poll_notifications(self) -> None:
        for sender, msg in self.transport.get_new_notifs():
            try:
                notif = self._peer_decoder.decode(msg)
            except msgspec.DecodeError:
                logger.warning("Dropped an undecodable notification from %s", sender)
                self._count("failed_notifications")
                continue
            if isinstance(notif, Notif):
                if self.sender is not None and notif.kind == "heartbeat":
                    notif = self.sender.heartbeat(notif)
                self.leases.notify(notif)
            elif self.sender is None or self.receiver is None:
                logger.warning(
                    "Dropped a push message from %s: this is not a push instance", sender
                )
                self._count("failed_notifications")
            elif isinstance(notif, PushRegistration):
                self.sender.register(sender, notif)
            elif isinstance(notif, Pushed):
                self.receiver.pushed(sender, notif)
            elif isinstance(notif, PushAlive):
                self.receiver.alive(notif)

    def _poll_loads(self) -> None:
        assert self.topology is not None
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
                del self._loads[req_id]
                logger.error(
                    "KV load of request %s from engine %s failed.",
                    req_id,
                    load.meta.remote_engine_id,
                )
                self._fail(
                    req_id,
                    load.local_block_ids,
                    "failed_transfers",
                    f"the KV read from prefill engine {load.meta.remote_engine_id} failed in "
                    "the transport",
                )
                continue
            if load.checks is None:
                self._check_lease(req_id, load)
                continue
            del self._loads[req_id]
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
                    load.local_block_ids,
                    "failed_transfers",
                    f"prefill engine {load.meta.remote_engine_id} released this request's KV "
                    "blocks (its lease there ended) before the read was checked",
                )
                continue
            if load.meta.staging_block_ids:
                assert self.host_buffer is not None
                self.host_buffer.load(load.meta.staging_block_ids, load.local_block_ids)
            self.topology.finish(load.local_block_ids, load.remote_tp)
            self._done_recving.add(req_id)
            self._count("transfers")
            self._count("transfer_seconds", time.perf_counter() - load.start)
            self._count("transfer_bytes", load.num_bytes)
            self._count("transfer_descriptors", load.num_descs)

    def _check_lease(self, req_id: str, load: _Load) -> None:
        """The data is in place: READ the lease's board slot from every remote rank read (with
        the `done` notification). Its tag there proves the prefill side still held the blocks
        for this request after every byte left them."""
        agents = load.engine.agents
        region, area = self._check_area(len(agents))
        slot, _ = load.meta.remote_lease
        num_blocks = self.topology.num_blocks if self.topology is not None else 0
        handles, checks = [], []
        try:
            for j, (agent, remote_meta) in enumerate(agents):
                # Loads in flight hold distinct blocks: the first one names a free entry.
                i = j * num_blocks + load.local_block_ids[0]
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
            del self._loads[req_id]
            self._fail(
                req_id,
                load.local_block_ids,
                "failed_transfers",
                f"the lease check with prefill engine {load.meta.remote_engine_id} failed to "
                f"start: {_why(e)}",
            )
            return
        load.handles, load.checks = handles, checks

    def _check_area(self, num_ranks: int) -> tuple[int, torch.Tensor]:
        """Where the board slots of reads from `num_ranks` remote ranks land, by local block."""
        if num_ranks not in self._checks:
            assert self.topology is not None
            area = torch.zeros(num_ranks * self.topology.num_blocks, dtype=torch.int64)
            self._checks[num_ranks] = (self.transport.register_region(area), area)
        return self._checks[num_ranks]

    def take_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def take_load_errors(self) -> dict[str, str]:
        errors, self._load_errors = self._load_errors, {}
        return errors

    def take_stats(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        return stats

    def shutdown(self) -> None:
        self._handshaker.shutdown(wait=False, cancel_futures=True)
        self.transport.shutdown()
