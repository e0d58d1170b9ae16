"""The NixlConnector's scheduler role: which requests read, which hold blocks, for how long.

Push mode (NixlPushConnector, docs/push.md) keeps the roles: a decode request still waits for
its blocks beyond the local hit, which its workers register with the prefill instance instead
of reading; a prefill request still holds its blocks under a lease, which ends once every
registrant was written, and its workers learn each step which of its blocks are final."""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from typing import TYPE_CHECKING

import msgspec

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.kv_connector.nixl.handshake import HandshakeServer
from pdserve.kv_connector.nixl.metadata import (
    AgentMetadata,
    HandshakePayload,
    LeaseStamp,
    NixlConnectorMetadata,
    PushReqMeta,
    RecvReqMeta,
    RemoteAddress,
)
from pdserve.kv_connector.nixl.staging import StagingPool
from pdserve.kv_transfer_params import KVTransferParams, RemoteLease
from pdserve.outputs import KVConnectorOutput
from pdserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.scheduler.block_pool import KVCacheBlock
    from pdserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)

# A prefill request that ends so is read; any other ending (an abort) is not.
# Only a request that ran out of tokens (the proxy's max_tokens=1 hop) has a decode leg to come:
# one the first token stopped (EOS, a stop token) is complete, and its blocks free at once.
_DONE = (RequestStatus.FINISHED_LENGTH_CAPPED,)
# In push mode a request named by a transfer id has its decode leg there already, which samples
# its own first token: a stop here is no reason not to push.
_PUSH_DONE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def _recv_meta(params: KVTransferParams, local_block_ids: list[int]) -> RecvReqMeta:
    """A read of the blocks `params` name into `local_block_ids` (none: only the prefill side's
    free); the caller checked `reads_remote()`."""
    lease = params.remote_lease
    return RecvReqMeta(
        local_block_ids,
        list(params.remote_block_ids or ()),
        params.remote_engine_id or "",
        params.remote_request_id or "",
        params.remote_host or "",
        params.remote_port or 0,
        params.remote_tp_size,
        remote_epoch=params.remote_epoch or "",
        remote_lease=(-1, 0) if lease is None else (lease.slot, lease.tag),
    )


def _read(params: KVTransferParams) -> KVTransferParams:
    """The params once their read is ordered (or declined): one transfer per request, also
    after a preemption."""
    return msgspec.structs.replace(params, do_remote_prefill=False)


def _first_token(request: Request) -> int | None:
    """The token this instance sampled: the decode side continues from it."""
    if request.num_tokens > request.num_prompt_tokens:
        return request.all_token_ids[request.num_prompt_tokens]
    return None


class LeaseBoard:
    """Prefill side: the slots of the workers' lease board, by request.

    A request that will be read gets a slot and a random tag at admission, before its params can
    leave this instance; the workers write the tag into the slot, and clear it when the lease
    ends (read, or expired) before they report the blocks free. A reader checks the slot after
    its READ: the tag proves the blocks were still this request's while it read. Without the
    workers' board size (no handshake metadata yet) slots are not bounded."""

    def __init__(self) -> None:
        self.num_slots: int | None = None
        self._free: deque[int] = deque()
        self._next = 0
        self.held: dict[str, LeaseStamp] = {}
        self.orders: dict[str, LeaseStamp] = {}  # for the next step's metadata

    def size(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = deque(range(num_slots))

    def has_room(self) -> bool:
        return self.num_slots is None or bool(self._free)

    def take(self, req_id: str) -> None:
        if self.num_slots is None:
            slot, self._next = self._next, self._next + 1
        else:
            slot = self._free.popleft()
        self.held[req_id] = self.orders[req_id] = LeaseStamp(slot, secrets.randbits(62) + 1)

    def clear(self, req_id: str) -> None:
        """The request will not be read: the workers clear its slot, which is free again (the
        clear comes before any later stamp of the slot: the workers apply orders in order)."""
        stamp = self.held.pop(req_id, None)
        if stamp is not None:
            self.orders[req_id] = LeaseStamp(stamp.slot, 0)
            self._release(stamp.slot)

    def ended(self, req_ids: set[str]) -> None:
        """Leases the workers ended (they cleared the slots themselves)."""
        for req_id in req_ids:
            stamp = self.held.pop(req_id, None)
            if stamp is not None:
                self._release(stamp.slot)

    def _release(self, slot: int) -> None:
        if self.num_slots is not None:
            self._free.append(slot)

    def take_orders(self) -> dict[str, LeaseStamp]:
        orders, self.orders = self.orders, {}
        return orders


class NixlConnectorScheduler:
    def __init__(self, config: EngineConfig, push: bool = False) -> None:
        kv = config.kv_transfer_config
        assert kv is not None
        self.push = push
        self.engine_id = kv.engine_id
        self.lease_duration = kv.kv_lease_duration
        self.tp_size = config.parallel_config.tensor_parallel_size
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.model_config.max_model_len
        self.side_channel_host = envs.side_channel_host()
        self.side_channel_port = envs.side_channel_port()
        self.server: HandshakeServer | None = None
        # This instance's incarnation, in its params and handshake answers: a decode instance
        # that knew an earlier one at the same address handshakes again.
        self.epoch = secrets.token_hex(8)
        self.board = LeaseBoard()
        self._reqs_need_recv: dict[str, RecvReqMeta] = {}
        self._reqs_need_send: dict[str, float] = {}
        # Decode side: request id -> (engine id, remote request id) of every request whose KV a
        # prefill instance holds for it, from its arrival (queued or not) until its read ends:
        # heartbeats keep those leases alive.
        self._awaited: dict[str, tuple[str, str]] = {}
        self._addresses: dict[str, RemoteAddress] = {}  # engine id -> its side channel
        # Engine id -> seconds between its heartbeats (a sixth of its lease, which its params
        # say; this instance's own otherwise), and when it last got one.
        self._beat_every: dict[str, float] = {}
        self._last_beat: dict[str, float] = {}
        # Decode side: reads (empty ones too) the workers have not reported done. Unlike
        # heartbeats they outlive an abort: the blocks stay held, and the engine must keep
        # polling the workers, until the read ends.
        self._reading: set[str] = set()
        # Prefill side: finished requests whose blocks wait for a reader. A set, not a count: a
        # stray id in finished_sending must not end the polling while others still wait.
        self._sending: set[str] = set()
        self.stats: dict[str, float] = {}
        self._last_meta = time.monotonic()  # the workers' last step
        # Push mode. Prefill side: requests whose blocks fill for a push (request, its block
        # list, which the KV cache manager extends in place), and transfer ids of requests
        # aborted since the last step. Decode side: requests aborted while their push is
        # awaited.
        self._pushing: dict[str, tuple[Request, list[KVCacheBlock]]] = {}
        self._push_aborts: list[str] = []
        self._push_cancels: list[str] = []
        # Decode side: requests that need nothing from the prefill side after all.
        self._declines: dict[str, RecvReqMeta] = {}
        self.recompute_failed_loads = kv.kv_load_failure_policy == "recompute"
        self._encoder = msgspec.msgpack.Encoder()
        # Host staging: the pool of the workers' staging buffer blocks (sized here when the
        # config says, else from the workers' handshake metadata).
        self.host_staging = kv.uses_host_staging(config.device)
        if push and self.host_staging:
            raise ValueError(
                "kv_transfer_config.kv_connector NixlPushConnector does not support host staging "
                "yet (kv_buffer_device 'cpu' with a CUDA KV cache, or host_staging): its writes "
                "go from cache to cache; use NixlConnector, or kv_buffer_device 'cuda'."
            )
        self.staging: StagingPool | None = None
        if self.host_staging and kv.host_buffer_blocks is not None:
            self._make_staging_pool(kv.host_buffer_blocks)

    def _make_staging_pool(self, num_blocks: int) -> None:
        self.staging = StagingPool(num_blocks, self.block_size, self.max_model_len)

    def set_xfer_handshake_metadata(self, metadata: dict[int, bytes | None]) -> None:
        served = {}
        for rank, encoded in metadata.items():
            payload = msgspec.msgpack.decode(encoded, type=HandshakePayload)
            agent = msgspec.msgpack.decode(payload.agent_metadata, type=AgentMetadata)
            agent.epoch = self.epoch
            payload.agent_metadata = msgspec.msgpack.encode(agent)
            served[rank] = msgspec.msgpack.encode(payload)
            if rank == 0:
                # Every rank's board has as many slots, and its staging buffer as many blocks.
                self.board.size(agent.board_slots)
                if self.host_staging and self.staging is None:
                    self._make_staging_pool(agent.num_blocks)
        self.server = HandshakeServer(self.side_channel_host, self.side_channel_port, served)

    def on_new_request(self, request: Request) -> None:
        """Decode side: a request that reads remote KV heart-beats from its arrival, so that a
        prefill instance keeps its blocks however long it queues here."""
        params = request.kv_transfer_params
        if params is not None and params.reads_remote(self.push):
            self._await(request.request_id, _recv_meta(params, []), params.remote_lease)

    def _await(self, req_id: str, read: RecvReqMeta, lease: RemoteLease | None) -> None:
        engine_id = read.remote_engine_id
        self._awaited[req_id] = (engine_id, read.remote_request_id)
        self._addresses[engine_id] = RemoteAddress(
            read.remote_host, read.remote_port, read.remote_tp_size
        )
        every = ((lease.seconds if lease else None) or self.lease_duration) / 6
        self._beat_every[engine_id] = min(self._beat_every.get(engine_id, every), every)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        # Without every remote field no read can start (update_state_after_alloc warns): the
        # request prefills here rather than wait for KV that never comes.
        if params is not None and params.reads_remote(self.push):
            count = request.num_prompt_tokens - num_computed_tokens
            if self.push and num_computed_tokens and count <= self.block_size:
                # The local hit holds all but at most a block: computing that here is quicker
                # than waiting for the prefill instance (it is told nothing is needed).
                return 0, False
            if count > 0:
                # The blocks beyond the local hit land in staging first: wait for room.
                staging = self.staging
                if (
                    staging is not None
                    and self._stages_read(params)
                    and not staging.can_read(request, num_computed_tokens)
                ):
                    return None, False
                return count, True
        elif params is not None and params.do_remote_decode and not self.push:
            if request.request_id not in self.board.held and not self.board.has_room():
                return None, False
            if self._stages_save(request):
                assert self.staging is not None
                if not self.staging.can_save(request):
                    return None, False
        return 0, False

    def _stages_read(self, params: KVTransferParams) -> bool:
        """Decode side: a READ lands in staging (heterogeneous TP has its own staging area,
        in host memory too when the buffer device is cpu)."""
        return self.staging is not None and params.remote_tp_size == self.tp_size

    def _stages_save(self, request: Request) -> bool:
        """Prefill side: a request that will stage and holds no staging blocks yet."""
        params = request.kv_transfer_params
        return (
            self.staging is not None
            and params is not None
            and params.do_remote_decode
            and not self.staging.holds_save(request.request_id)
        )

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if self._stages_save(request):
            assert self.staging is not None
            self.staging.reserve_save(request)
        if params is None:
            return
        if params.do_remote_decode and self.push:
            self._pushing[request.request_id] = (request, blocks)
        elif params.do_remote_decode and request.request_id not in self.board.held:
            self.board.take(request.request_id)
        if not params.do_remote_prefill:
            return
        if missing := params.missing_remote_fields(self.push):
            logger.warning(
                "Request %s: kv_transfer_params lack %s; it prefills locally.",
                request.request_id,
                ", ".join(missing),
            )
        else:
            # Blocks a local prefix hit filled are hashed; the rest wait for the remote bytes.
            # A full local hit reads nothing but must still tell the prefill side to free.
            local = (
                [b.block_id for b in blocks if b.block_hash is None] if num_external_tokens else []
            )
            if not local:
                # Computed here: the prefill instance hears that nothing is needed; this request
                # waits for no answer.
                self._declines[request.request_id] = _recv_meta(params, [])
                request.kv_transfer_params = _read(params)
                return
            staging_ids = []
            if local and self._stages_read(params):
                assert self.staging is not None
                staging_ids = self.staging.reserve_read(request.request_id, len(local))
            read = _recv_meta(params, local)
            read.staging_block_ids = staging_ids
            self._reqs_need_recv[request.request_id] = read
            self._await(request.request_id, read, params.remote_lease)
            self._reading.add(request.request_id)
            # The prefill instance's own prefix-cache hits: the client's cached tokens count
            # those of the tokens read here (scheduler/admission.py).
            if params.remote_cached_tokens:
                request.num_remote_cached_tokens = params.remote_cached_tokens
        # One transfer per request, also after a preemption.
        request.kv_transfer_params = _read(params)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes | None:
        return self._encoder.encode(self.build_meta(scheduler_output))

    def build_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        self._last_meta = time.monotonic()
        meta = NixlConnectorMetadata(self._reqs_need_recv, self._reqs_need_send)
        meta.declines, self._declines = self._declines, {}
        if self.staging is not None:
            meta.reqs_to_save = self.staging.save_orders(scheduler_output)
        meta.lease_stamps = self.board.take_orders()
        if self.push:
            self._push_orders(meta, scheduler_output)
        now = time.monotonic()
        for engine_id, remote_id in self._awaited.values():
            if engine_id in meta.heartbeats or (
                now - self._last_beat.get(engine_id, -1e18) >= self._beat_every[engine_id]
            ):
                meta.heartbeats.setdefault(engine_id, []).append(remote_id)
        for engine_id in meta.heartbeats:
            self._last_beat[engine_id] = now
        meta.remote_engines = {e: self._addresses[e] for e in meta.heartbeats}
        self._reqs_need_recv, self._reqs_need_send = {}, {}
        return meta

    def _push_orders(self, meta: NixlConnectorMetadata, scheduler_output: SchedulerOutput) -> None:
        """The step's push orders: the blocks each pushing request's step makes final (the
        request's numbers are still those from before the step), aborts, cancels."""
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            if req_id not in self._pushing:
                continue
            request, blocks = self._pushing[req_id]
            params = request.kv_transfer_params
            assert params is not None
            meta.reqs_to_push[req_id] = PushReqMeta(
                params.transfer_id or req_id,
                [b.block_id for b in blocks],
                request.num_prompt_tokens,
                min(request.num_computed_tokens + num_tokens, request.num_prompt_tokens),
            )
        meta.push_aborts, self._push_aborts = self._push_aborts, []
        meta.push_cancels, self._push_cancels = self._push_cancels, []

    def release_remote(self, request_id: str, params: KVTransferParams) -> bool:
        """Tell the prefill side to free a request's blocks now, with an empty read: this
        instance will never read them (aborted before admission, or rejected by the server)."""
        if not params.missing_remote_fields(self.push):
            self._reqs_need_recv[request_id] = _recv_meta(params, [])
            self._reading.add(request_id)
        return True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        # A decode request's heartbeats go on while its read is in flight (`_awaited` ends with
        # the read): the read holds the prefill side's blocks until it tells it.
        req_id = request.request_id
        if req_id not in self._reading:
            self._awaited.pop(req_id, None)
        elif self.push:
            self._push_cancels.append(req_id)  # the prefill side stops writing into its blocks
        params = request.kv_transfer_params
        if self.push and params is not None and params.do_remote_decode:
            return self._push_finished(request, block_ids, params)
        staging_ids = None
        if self.staging is not None and self.staging.holds_save(req_id):
            staging_ids = self.staging.end_save(request, request.status in _DONE)
            if staging_ids is None:
                self.board.clear(req_id)
                return False, None
        if params is None:
            return False, None
        if params.do_remote_prefill:
            # Finished (aborted) before it was ever scheduled: no read will come.
            self.release_remote(req_id, params)
            request.kv_transfer_params = _read(params)
            return False, None
        if not params.do_remote_decode:
            return False, None
        if request.status not in _DONE:
            self.board.clear(req_id)
            return False, None  # aborted: nobody will read
        # A staged copy is what the reader reads: the device blocks are free at once.
        remote_ids = block_ids if staging_ids is None else staging_ids
        if remote_ids:
            self._reqs_need_send[req_id] = time.time() + self.lease_duration
            self._sending.add(req_id)
        else:
            self.board.clear(req_id)
        stamp = self.board.held.get(req_id)
        lease = None if stamp is None else RemoteLease(stamp.slot, stamp.tag, self.lease_duration)
        params = self._reader_params(request, request.request_id, list(remote_ids), lease)
        return staging_ids is None and len(block_ids) > 0, params

    def _reader_params(
        self,
        request: Request,
        remote_request_id: str,
        remote_block_ids: list[int] | None = None,
        remote_lease: RemoteLease | None = None,
    ) -> KVTransferParams:
        """What a decode instance needs to load a finished request's KV from here."""
        return KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_request_id=remote_request_id,
            remote_host=self.side_channel_host,
            remote_port=self.server.port if self.server else self.side_channel_port,
            tp_size=self.tp_size,
            remote_num_tokens=request.num_computed_tokens,
            remote_cached_tokens=max(request.num_cached_tokens, 0),
            remote_epoch=self.epoch,
            first_token_id=_first_token(request),
            remote_block_ids=remote_block_ids,
            remote_lease=remote_lease,
        )

    def _push_finished(
        self, request: Request, block_ids: list[int], params: KVTransferParams
    ) -> tuple[bool, KVTransferParams | None]:
        """A pushing prefill request finished: its blocks stay held until every registrant was
        written (or its lease expired unregistered). Aborted, it frees at once: a write still
        reading its blocks only feeds a registration that ends failed."""
        req_id = request.request_id
        self._pushing.pop(req_id, None)
        transfer_id = params.transfer_id or req_id
        if request.status not in (_PUSH_DONE if params.transfer_id else _DONE):
            self._push_aborts.append(transfer_id)
            return False, None
        if not block_ids:
            return False, None
        self._reqs_need_send[req_id] = time.time() + self.lease_duration
        self._sending.add(req_id)
        # A decode instance registers with these after this answer (the sequential path: what
        # the proxy takes when it cannot send both hops at once).
        return True, self._reader_params(request, transfer_id)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        sent = output.finished_sending or set()
        self._sending.difference_update(sent)
        self.board.ended(sent)
        if self.staging is not None and (staged := self.staging.sent(sent)):
            # Their requests were freed when they finished: the ids are this connector's own.
            output.finished_sending = (sent - staged) or None
        for req_id in output.finished_recving or ():
            self._awaited.pop(req_id, None)
            self._reading.discard(req_id)
            if self.staging is not None:
                self.staging.read_ended(req_id)
        for name, value in (output.stats or {}).items():
            self.stats[name] = self.stats.get(name, 0.0) + value

    def get_stats(self) -> dict[str, float]:
        stats = dict(self.stats)
        if self.staging is not None:
            stats["staging_free_blocks"] = self.staging.num_free
            stats["staging_total_blocks"] = self.staging.num_blocks
        return stats

    def has_pending_transfers(self) -> bool:
        idle_poll = self.idle_poll_s()
        due = idle_poll is not None and time.monotonic() - self._last_meta >= idle_poll
        return bool(self._sending or self._reading) or due

    def idle_poll_s(self) -> float | None:
        # A push-mode prefill rank hears registrations, and their cancels, for requests this
        # half never held (a prefill hop refused, one already freed): only a step answers
        # them, where the decode side's watchdog would wait a lease.
        return self.lease_duration / 6 if self.push else None

    def load_failure_recomputes(self) -> bool:
        return self.recompute_failed_loads

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
