"""Processing a step's results: sampled tokens, stop checks, finished KV transfers, and the
end of requests, normal or aborted."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pdserve.outputs import EngineCoreOutput, KVConnectorOutput, LogprobsLists, ModelRunnerOutput
from pdserve.request import Request, RequestStatus
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.request_queue import RequestQueue

logger = logging.getLogger(__name__)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the finished status of a request whose last token ends it; True if it does."""
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    num_output_tokens = len(output_token_ids)
    if num_output_tokens >= params.min_tokens:
        last_token_id = output_token_ids[-1]
        if last_token_id == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    # Length limits hold whatever min_tokens asks: no position may pass max_model_len.
    max_tokens = request.max_tokens
    if (max_tokens is not None and num_output_tokens >= max_tokens) or (
        len(request.prompt_token_ids) + num_output_tokens >= max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def append_until_stop(
    request: Request, new_token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """Append tokens one by one; those after a stopping token are dropped."""
    for num_new, token_id in enumerate(new_token_ids, 1):
        request.append_output_token_ids(token_id)
        if check_stop(request, max_model_len):
            return new_token_ids[:num_new], True
    return new_token_ids, False


class SchedulerOutputProcessorMixin:
    """Part of `Scheduler`: everything that ends a request, normally or by abort."""

    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    skipped_waiting: RequestQueue
    kv_cache_manager: KVCacheManager
    connector: Any | None
    max_model_len: int
    finished_req_ids: set[str]
    finished_recving_kv_req_ids: set[str]

    if TYPE_CHECKING:  # defined by SchedulerKVTransferMixin

        def _update_from_kv_xfer_finished(
            self, kv_connector_output: KVConnectorOutput
        ) -> list[EngineCoreOutput]: ...

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, finish the requests they end, and report both.

        Async scheduling: each token replaces a placeholder. Tokens of requests that finished
        while the step was in flight, and of requests preempted since, are dropped.
        """
        logprobs = model_runner_output.logprobs
        requests = self.requests
        kv_cache_manager = self.kv_cache_manager
        enable_caching = kv_cache_manager.enable_caching
        max_model_len = self.max_model_len
        outputs: list[EngineCoreOutput] = []
        stopped_reqs: set[Request] = set()
        preempted = RequestStatus.PREEMPTED  # a status above it means finished
        sampled_token_ids = model_runner_output.sampled_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        for req_id in scheduler_output.num_scheduled_tokens:
            req_index = req_id_to_index.get(req_id)
            if req_index is None or not (new_token_ids := sampled_token_ids[req_index]):
                continue  # in the middle of a chunked prefill
            request = requests.get(req_id)
            if request is None or request.status > preempted:
                continue  # finished or aborted while the step ran (its blocks maybe still held)
            if request.num_async_tokens_to_discard:
                request.num_async_tokens_to_discard -= 1
                continue  # preempted while the step ran: it resumes without this token
            request.num_output_placeholders -= 1
            assert request.num_output_placeholders >= 0, "a token the scheduler did not expect"
            if len(new_token_ids) == 1:  # the norm: one token per request and step
                request.append_output_token_ids(new_token_ids)
                stopped = check_stop(request, max_model_len)
            else:
                new_token_ids, stopped = append_until_stop(request, new_token_ids, max_model_len)
            if enable_caching:
                # Blocks of tokens known only now; those the steps still in flight sample wait.
                kv_cache_manager.cache_blocks(
                    request, request.num_computed_tokens - request.num_output_placeholders
                )
            finish_reason = kv_transfer_params = None
            if stopped:
                finish_reason = int(request.get_finished_reason())
                kv_transfer_params = self._free_request(request)
                stopped_reqs.add(request)
            new_logprobs = None
            if logprobs is not None:
                # One row per request and step: row i belongs to the runner's request i.
                new_logprobs = LogprobsLists(
                    logprobs.logprob_token_ids[req_index : req_index + 1],
                    logprobs.logprobs[req_index : req_index + 1],
                    logprobs.sampled_token_ranks[req_index : req_index + 1],
                )
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    finish_reason=finish_reason,
                    stop_reason=request.stop_reason,
                    kv_transfer_params=kv_transfer_params,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
        if stopped_reqs:
            self.running = [r for r in self.running if r not in stopped_reqs]
        if model_runner_output.kv_connector_output is not None:
            outputs += self._update_from_kv_xfer_finished(model_runner_output.kv_connector_output)
        return outputs

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Abort path: finish requests from outside; unknown or finished ids are ignored."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        to_finish = []
        for req_id in dict.fromkeys(request_ids):
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                to_finish.append(request)
        running = {r for r in to_finish if r.status == RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if r not in running]
        waiting = [r for r in to_finish if r.status != RequestStatus.RUNNING]
        if waiting:
            self.waiting.remove_requests(waiting)
            self.skipped_waiting.remove_requests(waiting)
        for request in to_finish:
            delay_free_blocks = False
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # The worker may still write into its blocks until the transfer ends.
                delay_free_blocks = request.request_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(request.request_id)
            request.status = finished_status
            self._free_request(request, delay_free_blocks)

    def _free_request(
        self, request: Request, delay_free_blocks: bool = False
    ) -> dict[str, Any] | None:
        """Finish a request; its blocks wait if the connector still sends (or receives) them."""
        assert request.is_finished()
        kv_transfer_params = None
        if self.connector is not None:
            delay, kv_transfer_params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id)
            )
            delay_free_blocks |= delay
        self.finished_req_ids.add(request.request_id)
        if not delay_free_blocks:
            self._free_blocks(request)
        return kv_transfer_params

    def _free_blocks(self, request: Request) -> None:
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
