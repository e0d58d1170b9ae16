"""The scheduler's half of KV transfers: requests parked while a peer's KV loads into their
blocks, the blocks kept free for them, and what a finished or failed load means for each one
(reference §4.2; the connector's scheduler role decides what loads, this decides when)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pdserve.outputs import EngineCoreOutput, KVConnectorOutput
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.scheduler.block_pool import KVCacheBlock
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.request_queue import RequestQueue, SchedulingPolicy

logger = logging.getLogger(__name__)


class SchedulerKVTransferMixin:
    """Part of `Scheduler`: everything between a remote-prefill request's admission and its
    first scheduled step."""

    requests: dict[str, Request]
    policy: SchedulingPolicy
    waiting: RequestQueue
    skipped_waiting: RequestQueue
    kv_cache_manager: KVCacheManager
    connector: Any | None
    finished_recving_kv_req_ids: set[str]

    if TYPE_CHECKING:  # defined by SchedulerOutputProcessorMixin

        def _free_request(
            self, request: Request, delay_free_blocks: bool = False
        ) -> dict[str, Any] | None: ...

        def _free_blocks(self, request: Request) -> None: ...

    def _select_waiting_queue(self) -> RequestQueue:
        """The queue whose head is admitted next: under FCFS parked requests go first, under
        priority the better head."""
        if not self.skipped_waiting:
            return self.waiting
        if self.policy is SchedulingPolicy.FCFS or not self.waiting:
            return self.skipped_waiting
        skipped_first = self.skipped_waiting.peek_request() < self.waiting.peek_request()
        return self.skipped_waiting if skipped_first else self.waiting

    def _match_computed_tokens(
        self, request: Request
    ) -> tuple[list[KVCacheBlock], int, int, bool] | None:
        """Tokens a waiting request finds computed beyond its own `num_computed_tokens`:
        prefix-cache hits and their token count, then the tokens the connector loads beyond
        them and whether they load between steps. None: the connector cannot tell yet."""
        if self.kv_cache_manager.get_blocks(request.request_id):
            # Its remote KV arrived (or the part before a block that failed): nothing to add.
            return [], 0, 0, False
        hits, num_local_tokens = self.kv_cache_manager.get_computed_blocks(request)
        if self.connector is None:
            return hits, num_local_tokens, 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(
            request, num_local_tokens
        )
        if num_external is None:
            return None
        return hits, num_local_tokens, num_external, load_async

    def _num_blocks_short(self, request: Request, num_slotted_tokens: int) -> int:
        """Blocks the request lacks for all its known tokens while it has slots for only
        `num_slotted_tokens`."""
        block_size = self.kv_cache_manager.block_size
        return max(0, -(-request.num_tokens // block_size) - -(-num_slotted_tokens // block_size))

    def _num_blocks_to_complete(self, request: Request) -> int:
        """What a waiting request that holds blocks (its KV is loading, or arrived) still needs
        for all its known tokens; 0 for one that holds none."""
        held = self.kv_cache_manager.req_to_blocks.get(request.request_id)
        if not held:
            return 0
        return self._num_blocks_short(request, len(held) * self.kv_cache_manager.block_size)

    def _num_reserved_blocks(self) -> int:
        """Blocks no waiting admission may take: the parked loads will need them to prefill the
        rest of their prompts. Running requests may still grow into them; they finish (or are
        preempted) and give them back, while parked requests free nothing until they run."""
        return sum(self._num_blocks_to_complete(r) for r in self.skipped_waiting)

    def _update_from_kv_xfer_finished(
        self, kv_connector_output: KVConnectorOutput
    ) -> list[EngineCoreOutput]:
        """Transfers the workers finished: promote received requests, free what was sent, and
        apply the load-failure policy; returns the outputs of requests that failed.

        An id that fits no request waiting on that transfer is logged and ignored: a confused
        peer must not take the engine down.
        """
        if self.connector is not None:
            self.connector.update_connector_output(kv_connector_output)
        for req_id in kv_connector_output.finished_recving or ():
            request = self.requests.get(req_id)
            if request is None:
                # The empty read of a request aborted before admission (it only tells the
                # prefill side to free) ends for a request that is already gone.
                logger.debug("Finished KV receive for unknown request %s; ignored.", req_id)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            elif request.is_finished():
                # Aborted (or failed) while receiving: its blocks were held until now.
                self._free_blocks(request)
            else:
                logger.warning("Unexpected finished KV receive for request %s; ignored.", req_id)
        for req_id in kv_connector_output.finished_sending or ():
            request = self.requests.get(req_id)
            if request is not None and request.is_finished():
                self._free_blocks(request)
            else:
                logger.warning("Unexpected finished KV send for request %s; ignored.", req_id)
        if kv_connector_output.invalid_block_ids:
            return self._handle_failed_loads(kv_connector_output.invalid_block_ids)
        return []

    def _handle_failed_loads(self, invalid_block_ids: set[int]) -> list[EngineCoreOutput]:
        """Requests whose load left blocks unwritten: under policy "fail" they end with an error;
        under "recompute" they keep the tokens before their first bad block and prefill the rest.

        The bad blocks are never hashed: loaded blocks are cached only at promotion, and only up
        to `num_computed_tokens`, which stops before them.
        """
        assert self.connector is not None
        recompute = self.connector.kv_transfer_config.kv_load_failure_policy == "recompute"
        block_size = self.kv_cache_manager.block_size
        failed: list[Request] = []
        for request in self.skipped_waiting:
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            first_bad = next((i for i, b in enumerate(block_ids) if b in invalid_block_ids), None)
            if first_bad is None:
                continue
            logger.warning(
                "KV load of request %s failed from block %d of %d; %s.",
                request.request_id,
                first_bad,
                len(block_ids),
                "recomputing the rest" if recompute else "the request fails",
            )
            if recompute:
                num_good_tokens = first_bad * block_size
                request.num_computed_tokens = min(request.num_computed_tokens, num_good_tokens)
            else:
                failed.append(request)
        if not failed:
            return []
        self.skipped_waiting.remove_requests(failed)
        outputs = []
        for request in failed:
            # Until the transfer is reported done the worker may still write into the blocks.
            recv_done = request.request_id in self.finished_recving_kv_req_ids
            self.finished_recving_kv_req_ids.discard(request.request_id)
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request, delay_free_blocks=not recv_done)
            outputs.append(
                EngineCoreOutput(request.request_id, [], finish_reason=int(FinishReason.ERROR))
            )
        return outputs

    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        """Promote a request whose KV transfer finished; False while it is still in flight."""
        if request.request_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.remove(request.request_id)
        # The received blocks are valid now: index them for later prefix hits.
        if self.kv_cache_manager.enable_caching:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            # The whole prompt arrived: recompute its last token, to sample from its logits.
            request.num_computed_tokens = request.num_tokens - 1
        request.status = (
            RequestStatus.PREEMPTED if request.num_preemptions > 0 else RequestStatus.WAITING
        )
        return True
