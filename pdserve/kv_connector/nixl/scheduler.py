"""The NixlConnector's scheduler role: which requests read, which hold blocks, for how long.

Push mode (NixlPushConnector, docs/push.md) keeps the roles: a decode request still waits for
its blocks beyond the local hit, which its workers register with the prefill instance instead
of reading; a prefill request still holds its blocks under a lease, which ends once every
registrant was written, and its workers learn each step which of its blocks are final."""

from __future__ import annotations

import logging
import secrets
import time
from typing import TYPE_CHECKING

import msgspec

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.kv_connector.nixl.handshake import HandshakeServer
from pdserve.kv_connector.nixl.metadata import (
    AgentMetadata,
    HandshakePayload,
    NixlConnectorMetadata,
    RecvReqMeta,
)
from pdserve.kv_connector.nixl.push_orders import DONE, NoPush, PushOrders
from pdserve.kv_connector.nixl.scheduler_leases import Heartbeats, LeaseBoard
from pdserve.kv_connector.nixl.staging import StagingPool
from pdserve.kv_transfer_params import KVTransferParams, RemoteLease
from pdserve.outputs import KVConnectorOutput
from pdserve.request import Request

if TYPE_CHECKING:
    from pdserve.scheduler.block_pool import KVCacheBlock
    from pdserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


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


class NixlConnectorScheduler:
    """Composed by role: the decode side's reads and heartbeats, the prefill side's lease board
    and held blocks, the push orders (`NoPush` for a pull connector), host staging."""

    def __init__(self, config: EngineConfig, push: bool = False) -> None:
        kv = config.kv_transfer_config
        assert kv is not None
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
        self.heartbeats = Heartbeats(self.lease_duration)
        self.push: PushOrders | NoPush = PushOrders(self.lease_duration) if push else NoPush()
        self._reqs_need_recv: dict[str, RecvReqMeta] = {}
        self._reqs_need_send: dict[str, float] = {}
        # Decode side: reads (empty ones too) the workers have not reported done. Unlike
        # heartbeats they outlive an abort: the blocks stay held, and the engine must keep
        # polling the workers, until the read ends.
        self._reading: set[str] = set()
        # Prefill side: finished requests whose blocks wait for a reader. A set, not a count: a
        # stray id in finished_sending must not end the polling while others still wait.
        self._sending: set[str] = set()
        self.stats: dict[str, float] = {}
        self._last_meta = time.monotonic()  # the workers' last step
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
        if params is not None and params.reads_remote(self.push.enabled):
            self.heartbeats.watch(request.request_id, _recv_meta(params, []), params.remote_lease)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        # Without every remote field no read can start (update_state_after_alloc warns): the
        # request prefills here rather than wait for KV that never comes.
        if params is not None and params.reads_remote(self.push.enabled):
            count = request.num_prompt_tokens - num_computed_tokens
            if self.push.declines_rest(num_computed_tokens, count, self.block_size):
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
        elif params is not None and params.do_remote_decode and not self.push.enabled:
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
        if params.do_remote_decode and not self.push.admit(request, blocks):
            if request.request_id not in self.board.held:
                self.board.take(request.request_id)
        if not params.do_remote_prefill:
            return
        if missing := params.missing_remote_fields(self.push.enabled):
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
            self.heartbeats.watch(request.request_id, read, params.remote_lease)
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
        self.push.orders(meta, scheduler_output)
        self.heartbeats.due(meta)
        self._reqs_need_recv, self._reqs_need_send = {}, {}
        return meta

    def release_remote(self, request_id: str, params: KVTransferParams) -> bool:
        """Tell the prefill side to free a request's blocks now, with an empty read: this
        instance will never read them (aborted before admission, or rejected by the server)."""
        if not params.missing_remote_fields(self.push.enabled):
            self._reqs_need_recv[request_id] = _recv_meta(params, [])
            self._reading.add(request_id)
        return True

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVTransferParams | None]:
        # A decode request's heartbeats go on while its read is in flight (they end with the
        # read): the read holds the prefill side's blocks until it tells it.
        req_id = request.request_id
        if req_id not in self._reading:
            self.heartbeats.end(req_id)
        else:
            self.push.cancel(req_id)  # the prefill side stops writing into its blocks
        params = request.kv_transfer_params
        if isinstance(self.push, PushOrders) and params is not None and params.do_remote_decode:
            transfer_id = self.push.finished(request, params)
            if transfer_id is None or not block_ids:
                return False, None
            self._hold(req_id)
            # A decode instance registers with these after this answer (the sequential path:
            # what the proxy takes when it cannot send both hops at once).
            return True, self._reader_params(request, transfer_id)
        staging_ids = None
        if self.staging is not None and self.staging.holds_save(req_id):
            staging_ids = self.staging.end_save(request, request.status in DONE)
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
        if request.status not in DONE:
            self.board.clear(req_id)
            return False, None  # aborted: nobody will read
        # A staged copy is what the reader reads: the device blocks are free at once.
        remote_ids = block_ids if staging_ids is None else staging_ids
        if remote_ids:
            self._hold(req_id)
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

    def _hold(self, req_id: str) -> None:
        """Prefill side: the request's blocks wait for their reader, under a lease."""
        self._reqs_need_send[req_id] = time.time() + self.lease_duration
        self._sending.add(req_id)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        sent = output.finished_sending or set()
        self._sending.difference_update(sent)
        self.board.ended(sent)
        if self.staging is not None and (staged := self.staging.sent(sent)):
            # Their requests were freed when they finished: the ids are this connector's own.
            output.finished_sending = (sent - staged) or None
        for req_id in output.finished_recving or ():
            self.heartbeats.end(req_id)
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
        return self.push.idle_poll_s()

    def load_failure_recomputes(self) -> bool:
        return self.recompute_failed_loads

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
