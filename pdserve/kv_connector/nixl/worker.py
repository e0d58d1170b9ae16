"""The NixlConnector's worker role: handshakes, the request's KV moved, leases held.

Decode side: a request to load is parked until its prefill engine is known (a handshake in a
background thread), then its blocks are READ (reader.py) or, in push mode (NixlPushConnector),
registered for the prefill side to WRITE (push.py). Prefill side: finished requests hold their
blocks under a lease (lease.py) that peers' notifications and heartbeats renew and end. Nothing
here raises out of a step: a failure ends the one request (its blocks reported invalid) and is
counted.

With host staging the transport registers a host buffer instead of the cache: the prefill side
copies a request's blocks into it after the forward pass that completes its prompt, the decode
side READs into it and copies into the cache before it reports the load done (staging.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
import torch

from pdserve.config import EngineConfig
from pdserve.kv_connector.nixl.handshake import (
    client_reason,
)
from pdserve.kv_connector.nixl.handshaker import Handshaker
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
    model_factors,
    send,
)
from pdserve.kv_connector.nixl.push import PushReceiver, PushSender
from pdserve.kv_connector.nixl.reader import KVReader
from pdserve.kv_connector.nixl.staging import HostBuffer
from pdserve.kv_connector.nixl.topology import RemoteEngine, Topology
from pdserve.kv_connector.transport.base import (
    make_transport,
    memory_kind,
)
from pdserve.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from pdserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


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
        self.model_factors = model_factors(config)
        self.enforce_handshake_compat = kv.enforce_handshake_compat
        self.host_staging = kv.uses_host_staging(config.device)
        self.host_buffer_blocks = kv.host_buffer_blocks
        self.transport = make_transport(
            kv.transport,
            f"{self.engine_id}:{tp_rank}",
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
        self.handshaker: Handshaker | None = None  # once the cache is registered
        self._waiting: dict[str, RecvReqMeta] = {}  # for their engine's handshake
        self._done_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._load_errors: dict[str, str] = {}  # request id -> why its load failed
        # Prefill side: the leases of finished requests' blocks, and the board peers check.
        self.leases = LeaseHolder(self.lease_duration)
        self._stats: dict[str, float] = {}
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.board_region = -1
        # Decode side: requests that already handshook again because their prefill instance's
        # epoch had changed.
        self._rehandshaked: set[str] = set()
        # Set once the cache is registered: the READ path, or push mode's two sides. The
        # requests of `_waiting` that decline (they ask for nothing and report nothing).
        self.reader: KVReader | None = None
        self.sender: PushSender | None = None
        self.receiver: PushReceiver | None = None
        self._declined: set[str] = set()
        self._peer_decoder = msgspec.msgpack.Decoder(PeerMessage)

    # ---- set-up -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.compat_factors = compatibility_factors(
            kv_cache, self.tp_size, self.transport_name, self.model_factors
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
            kv_cache,
            self.tp_rank,
            self.tp_size,
            self.transport,
            region.device,
        )
        self.handshaker = Handshaker(
            self.transport,
            self.transport_name,
            self.topology,
            region,
            self.compat_factors if self.enforce_handshake_compat else None,
            self.handshake_timeout,
            self.lease_duration,
            self._count,
        )
        if not self.push:
            self.reader = KVReader(self.transport, self.topology, self.host_buffer, self._count)
        else:
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
        assert self.handshaker is not None
        for engine_id, remote_ids in meta.heartbeats.items():
            engine = self.handshaker.engines.get(engine_id)
            if engine is not None:
                self._notify(engine, Notif("heartbeat", remote_ids))
            elif engine_id in meta.remote_engines:
                self.handshaker.prepare(engine_id, meta.remote_engines[engine_id])
        self._start_loads()

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
        assert self.handshaker is not None
        engines = self.handshaker.engines
        for req_id, meta in list(self._waiting.items()):
            engine_id = meta.remote_engine_id
            engine = engines.get(engine_id)
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
                del engines[engine_id]
                engine = None
            if engine is None:
                address = RemoteAddress(meta.remote_host, meta.remote_port, meta.remote_tp_size)
                self.handshaker.start(engine_id, address)
                continue
            del self._waiting[req_id]
            self._rehandshaked.discard(req_id)
            report = req_id not in self._declined
            self._declined.discard(req_id)
            try:
                if self.receiver is not None:
                    self.receiver.register(req_id, meta, engine, report)
                else:
                    assert self.reader is not None
                    self.reader.read(req_id, meta, engine, report)
            except Exception as e:  # a bad descriptor, a vanished agent: this request only
                logger.error("KV load of request %s failed to start: %s", req_id, e)
                self._fail(
                    req_id,
                    meta.local_block_ids,
                    "failed_transfers",
                    f"the KV read from prefill engine {engine_id} failed to start: {client_reason(e)}",
                )

    def _notify(self, engine: RemoteEngine, notif: Notif) -> None:
        for agent, _ in engine.agents:
            if not send(self.transport, agent, notif):
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
        if self.reader is not None:
            self.reader.poll()
            self._collect(self.reader)
        if self.sender is not None and self.receiver is not None:
            self.sender.forget(done_sending)
            self.receiver.check_watchdogs()
            self._collect(self.receiver)
        done_recving, self._done_recving = self._done_recving, set()
        return done_sending or None, done_recving or None

    def _collect(self, part: KVReader | PushReceiver) -> None:
        """The loads `part` finished or failed since the last step."""
        self._done_recving |= part.done
        part.done = set()
        for req_id, (block_ids, why) in part.failed.items():
            self._fail(req_id, block_ids, "failed_transfers", why)
        part.failed = {}

    def _finish_handshakes(self) -> None:
        if self.handshaker is None:
            return
        for engine_id, e in self.handshaker.finished().items():
            reason = f"the KV handshake with prefill engine {engine_id} failed: {client_reason(e)}"
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
        if self.handshaker is not None:
            self.handshaker.shutdown()
        self.transport.shutdown()
