"""Requests that wait for a peer's KV: parked while it loads into their blocks, the blocks kept
free for them, and what a finished or failed load means for each one (reference §4.2; the
connector's scheduler role decides what loads, this decides when).

`RemoteKVRequests` owns that state and answers with decisions (which requests to free, which
failed); the Scheduler acts on them.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from pdserve.kv_connector.base import KVConnectorScheduler
from pdserve.outputs import KVConnectorOutput
from pdserve.request import Request, RequestStatus
from pdserve.scheduler.block_pool import KVCacheBlock
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from pdserve.utils import cdiv

logger = logging.getLogger(__name__)

# When the connector gave no reason for a failed load.
_UNKNOWN_LOAD_ERROR = "the KV read failed (this instance's log says why)"


class FailedLoad(NamedTuple):
    request: Request
    worker_done: bool  # whether the worker is done with its blocks (else they wait for it)
    reason: str  # for the request's client


class TransferDecisions(NamedTuple):
    """What the workers' transfer news asks of the Scheduler."""

    # Finished requests whose blocks a transfer held until now: free them.
    to_free: list[Request]
    # Loads that failed under policy "fail": end them with an error, their blocks freed only
    # once the worker is done.
    failed: list[FailedLoad]


class RemoteKVRequests:
    """The parked queue (`skipped_waiting`: loads in flight, and requests the connector cannot
    decide yet), the ids whose loads finished (`finished_recving_kv_req_ids`), and finished
    requests whose blocks a read still holds (`receiving`).

    A finished request holds its blocks for one transfer: a read into them (decode side, in
    `receiving`), or a reader of them (prefill side, the connector's delay). Only that
    transfer's end frees them: a report of the other kind is ignored, whatever the order.
    """

    def __init__(
        self,
        policy: SchedulingPolicy,
        kv_cache_manager: KVCacheManager,
        connector: KVConnectorScheduler,
        has_state: bool = False,
    ) -> None:
        self.policy = policy
        # A recurrent state (Mamba) cannot take its last token back: the prompt's last token
        # cannot be computed again on top of the state that already holds it.
        self.has_state = has_state
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.skipped_waiting = create_request_queue(policy)
        self.finished_recving_kv_req_ids: set[str] = set()
        self.receiving: set[str] = set()

    def __len__(self) -> int:
        return len(self.skipped_waiting)

    def add(self, request: Request) -> None:
        self.skipped_waiting.add_request(request)

    def park(self, requests: RequestQueue) -> None:
        """Requests set aside this step: they are looked at first next step."""
        self.skipped_waiting.prepend_requests(requests)

    def remove(self, requests: list[Request]) -> None:
        self.skipped_waiting.remove_requests(requests)

    def select_queue(self, waiting: RequestQueue) -> RequestQueue:
        """The queue whose head is admitted next: under FCFS parked requests go first, under
        priority the better head."""
        skipped = self.skipped_waiting
        if not skipped:
            return waiting
        if self.policy is SchedulingPolicy.FCFS or not waiting:
            return skipped
        return skipped if skipped.peek_request() < waiting.peek_request() else waiting

    def try_promote(self, request: Request) -> bool:
        """Promote a request whose KV transfer finished; False while it is still in flight."""
        if request.request_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.remove(request.request_id)
        # The received blocks are valid now: index them for later prefix hits.
        if self.kv_cache_manager.enable_caching:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            # The whole prompt arrived: recompute its last token, to sample from its logits.
            # A state model (no shipped token to continue from) computes its prompt again.
            request.num_computed_tokens = 0 if self.has_state else request.num_tokens - 1
        request.status = (
            RequestStatus.PREEMPTED if request.num_preemptions > 0 else RequestStatus.WAITING
        )
        return True

    def match_computed_tokens(
        self, request: Request
    ) -> tuple[list[KVCacheBlock], int, int, bool] | None:
        """Tokens a waiting request finds computed beyond its own `num_computed_tokens`:
        prefix-cache hits and their token count, then the tokens the connector loads beyond
        them and whether they load between steps. None: the connector cannot tell yet."""
        if self.kv_cache_manager.get_blocks(request.request_id):
            # Its remote KV arrived (or the part before a block that failed): nothing to add.
            return [], 0, 0, False
        hits, num_local_tokens = self.kv_cache_manager.get_computed_blocks(request)
        num_external, load_async = self.connector.get_num_new_matched_tokens(
            request, num_local_tokens
        )
        if num_external is None:
            return None
        return hits, num_local_tokens, num_external, load_async

    def num_reserved_blocks(self) -> int:
        """Blocks no waiting admission may take: the parked loads will need them to prefill the
        rest of their prompts. Running requests may still grow into them; they finish (or are
        preempted) and give them back, while parked requests free nothing until they run."""
        return sum(self._num_blocks_to_complete(r) for r in self.skipped_waiting)

    def reservation_change(
        self, request: Request, num_computed_tokens: int, load_kv_async: bool
    ) -> int:
        """How admitting `request` changes the reserve: it no longer needs its own share, and an
        async load is admitted only if the rest of its prompt fits too (two loads that each hold
        part of the pool could otherwise wait for each other's blocks forever)."""
        margin = self._num_blocks_short(request, num_computed_tokens) if load_kv_async else 0
        return margin - self._num_blocks_to_complete(request)

    def _num_blocks_short(self, request: Request, num_slotted_tokens: int) -> int:
        """Blocks the request lacks for all its known tokens while it has slots for only
        `num_slotted_tokens`."""
        block_size = self.kv_cache_manager.block_size
        return max(0, cdiv(request.num_tokens, block_size) - cdiv(num_slotted_tokens, block_size))

    def _num_blocks_to_complete(self, request: Request) -> int:
        """What a waiting request that holds blocks (its KV is loading, or arrived) still needs
        for all its known tokens; 0 for one that holds none."""
        held = self.kv_cache_manager.req_to_blocks.get(request.request_id)
        if not held:
            return 0
        return self._num_blocks_short(request, len(held) * self.kv_cache_manager.block_size)

    def finish(self, request: Request) -> bool:
        """A parked request ends from outside; True if its blocks must wait: the worker may
        still write into them until the transfer is reported done."""
        recv_done = request.request_id in self.finished_recving_kv_req_ids
        self.finished_recving_kv_req_ids.discard(request.request_id)
        if not recv_done:
            self.receiving.add(request.request_id)
        return not recv_done

    def update_from_kv_xfer_finished(
        self, kv_connector_output: KVConnectorOutput, requests: dict[str, Request]
    ) -> TransferDecisions:
        """Transfers the workers finished: note received requests for promotion, and say which
        requests to free and which failed under the load-failure policy.

        An id that fits no request waiting on that transfer is logged and ignored: a confused
        peer must not take the engine down.
        """
        self.connector.update_connector_output(kv_connector_output)
        to_free: dict[str, Request] = {}
        for req_id in kv_connector_output.finished_recving or ():
            request = requests.get(req_id)
            if request is None:
                # The empty read of a request aborted before admission (it only tells the
                # prefill side to free) ends for a request that is already gone.
                logger.debug("Finished KV receive for unknown request %s; ignored.", req_id)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
            elif req_id in self.receiving:
                # Aborted (or failed) while receiving: its blocks were held until now.
                self.receiving.remove(req_id)
                to_free[req_id] = request
            else:
                logger.warning("Unexpected finished KV receive for request %s; ignored.", req_id)
        for req_id in kv_connector_output.finished_sending or ():
            request = requests.get(req_id)
            if (
                request is not None
                and request.is_finished()
                and req_id not in self.receiving
                and req_id not in to_free
            ):
                to_free[req_id] = request
            else:
                logger.warning("Unexpected finished KV send for request %s; ignored.", req_id)
        failed = []
        if kv_connector_output.invalid_block_ids:
            failed = self._apply_load_failure_policy(
                kv_connector_output.invalid_block_ids, kv_connector_output.load_errors or {}
            )
        return TransferDecisions(list(to_free.values()), failed)

    def _apply_load_failure_policy(
        self, invalid_block_ids: set[int], load_errors: dict[str, str]
    ) -> list[FailedLoad]:
        """Requests whose load left blocks unwritten: under policy "recompute" they keep the
        tokens before their first bad block and prefill the rest; under "fail" they leave the
        queue and are returned with the connector's reason.

        The bad blocks are never hashed: loaded blocks are cached only at promotion, and only up
        to `num_computed_tokens`, which stops before them.
        """
        recompute = self.connector.load_failure_recomputes()
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
                "KV load of request %s failed from block %d of %d (%s); %s.",
                request.request_id,
                first_bad,
                len(block_ids),
                load_errors.get(request.request_id, "no reason given"),
                "recomputing the rest" if recompute else "the request fails",
            )
            if recompute:
                num_good_tokens = first_bad * block_size
                request.num_computed_tokens = min(request.num_computed_tokens, num_good_tokens)
                request.kv_load_recomputed = True
            else:
                failed.append(request)
        if not failed:
            return []
        self.skipped_waiting.remove_requests(failed)
        return [
            FailedLoad(
                request,
                not self.finish(request),
                load_errors.get(request.request_id, _UNKNOWN_LOAD_ERROR),
            )
            for request in failed
        ]
