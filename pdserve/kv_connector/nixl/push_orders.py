"""The scheduler half's push orders (NixlPushConnector, docs/push.md), decided once: a pull
connector has `NoPush`, whose answers leave every request to the pull path.

Prefill side: the requests whose blocks fill for a push (the request and its block list, which
the KV cache manager extends in place), the blocks each step makes final, and the transfer ids
of requests aborted here. Decode side: requests aborted while a push into their blocks is
awaited (the prefill side stops writing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.kv_connector.nixl.metadata import NixlConnectorMetadata, PushReqMeta
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.scheduler.block_pool import KVCacheBlock
    from pdserve.scheduler.output import SchedulerOutput

# A prefill request that ends so is read; any other ending (an abort) is not.
# Only a request that ran out of tokens (the proxy's max_tokens=1 hop) has a decode leg to come:
# one the first token stopped (EOS, a stop token) is complete, and its blocks free at once.
DONE = (RequestStatus.FINISHED_LENGTH_CAPPED,)
# In push mode a request named by a transfer id has its decode leg there already, which samples
# its own first token: a stop here is no reason not to push.
_PUSH_DONE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


class PushOrders:
    enabled = True

    def __init__(self, lease_duration: float) -> None:
        self.lease_duration = lease_duration
        self._pushing: dict[str, tuple[Request, list[KVCacheBlock]]] = {}
        self._aborts: list[str] = []
        self._cancels: list[str] = []

    def declines_rest(self, num_computed_tokens: int, num_rest: int, block_size: int) -> bool:
        """Decode side: the local hit holds all but at most a block, which is quicker to
        compute here than to wait for (the prefill instance is told nothing is needed)."""
        return num_computed_tokens > 0 and num_rest <= block_size

    def admit(self, request: Request, blocks: list[KVCacheBlock]) -> bool:
        """Prefill side: a request to push (True), which takes no lease board slot."""
        self._pushing[request.request_id] = (request, blocks)
        return True

    def cancel(self, req_id: str) -> None:
        self._cancels.append(req_id)

    def finished(self, request: Request, params: KVTransferParams) -> str | None:
        """Prefill side: the transfer id whose registrants the finished request's blocks wait
        for, or None when it was aborted (it frees at once: a write still reading its blocks
        only feeds a registration that ends failed)."""
        self._pushing.pop(request.request_id, None)
        transfer_id = params.transfer_id or request.request_id
        if request.status not in (_PUSH_DONE if params.transfer_id else DONE):
            self._aborts.append(transfer_id)
            return None
        return transfer_id

    def orders(self, meta: NixlConnectorMetadata, scheduler_output: SchedulerOutput) -> None:
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
        meta.push_aborts, self._aborts = self._aborts, []
        meta.push_cancels, self._cancels = self._cancels, []

    def idle_poll_s(self) -> float | None:
        # A push-mode prefill rank hears registrations, and their cancels, for requests this
        # half never held (a prefill hop refused, one already freed): only a step answers
        # them, where the decode side's watchdog would wait a lease.
        return self.lease_duration / 6


class NoPush:
    """The pull connector's: nothing is pushed."""

    enabled = False

    def declines_rest(self, num_computed_tokens: int, num_rest: int, block_size: int) -> bool:
        return False

    def admit(self, request: Request, blocks: list[KVCacheBlock]) -> bool:
        return False

    def cancel(self, req_id: str) -> None:
        pass

    def orders(self, meta: NixlConnectorMetadata, scheduler_output: SchedulerOutput) -> None:
        pass

    def idle_poll_s(self) -> float | None:
        return None
