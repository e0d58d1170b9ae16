"""The scheduler: which requests run this step, how many tokens each, and what came out of it.

Continuous batching with no prefill or decode phases: every request has `num_computed_tokens`
and `num_tokens`, and each step hands out a token budget so that the former catches up, running
requests first, then waiting ones (vLLM V1, `vllm/v1/core/sched/scheduler.py`). The step's
SchedulerOutput is built in output_builder.py; its results are processed in output_processor.py;
requests whose KV loads from a peer are parked and promoted in kv_transfer.py.

Async scheduling (vLLM's AsyncScheduler, folded in): a step that samples leaves a placeholder
token that the next schedule() counts; see docs/async_scheduling.md.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.request import Request, RequestStatus
from pdserve.scheduler.block_pool import KVCacheBlock
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.kv_transfer import SchedulerKVTransferMixin
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.output_builder import SchedulerOutputBuilderMixin
from pdserve.scheduler.output_processor import SchedulerOutputProcessorMixin
from pdserve.scheduler.request_queue import SchedulingPolicy, create_request_queue

logger = logging.getLogger(__name__)


class SchedulerStats(msgspec.Struct, array_like=True):
    """A snapshot sent to the front end with every batch of outputs (feeds /metrics)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    # Free blocks == num_blocks - 1 (the null block) means nothing is held: tests assert it.
    num_free_blocks: int
    num_blocks: int


class Scheduler(
    SchedulerOutputBuilderMixin, SchedulerOutputProcessorMixin, SchedulerKVTransferMixin
):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        use_v2_model_runner: bool,
        kv_connector: Any | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        self.use_v2_model_runner = use_v2_model_runner
        self.connector = kv_connector
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        # EngineConfig resolves the budget; a bare SchedulerConfig gets the same default.
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens or (
            2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        )
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, max_model_len, cache_config.enable_prefix_caching
        )

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        # Requests that cannot be scheduled yet (waiting for a KV transfer, or for the
        # connector to decide); looked at before `waiting` each step.
        self.skipped_waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Ids finished / preempted since the last step. Rebound (never cleared) after each
        # schedule(): the SchedulerOutput just built holds the old set objects.
        self.finished_req_ids: set[str] = set()
        self.reset_preempted_req_ids: set[str] = set()
        # Runner V1 only: requests not scheduled in the previous step get all their tokens.
        self.prev_step_scheduled_req_ids: set[str] = set()
        self.finished_recving_kv_req_ids: set[str] = set()
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        # The engine rejects prompts longer than max_model_len before they get here.
        assert request.num_prompt_tokens <= self.max_model_len, "prompt longer than max_model_len"
        self.requests[request.request_id] = request
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.skipped_waiting.add_request(request)
        else:
            self.waiting.add_request(request)

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_scheduled_tokens
        num_scheduled_tokens: dict[str, int] = {}
        req_to_new_blocks: dict[str, list[KVCacheBlock]] = {}
        scheduled_running_reqs: list[Request] = []
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        preempted = False
        allocate_slots = self.kv_cache_manager.allocate_slots
        max_len_cap = self.max_model_len - 1

        # 1. Running requests, in admission order: decodes and unfinished prefill chunks alike.
        running = self.running
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_computed = request.num_computed_tokens
            num_placeholders = request.num_output_placeholders
            if (
                num_placeholders
                and request.max_tokens is not None
                and (request.num_output_tokens + num_placeholders >= request.max_tokens)
            ):
                # Async: the steps in flight already sample the last token max_tokens allows.
                req_index += 1
                continue
            # Placeholders count as tokens: the runner feeds the one it sampled itself.
            num_new_tokens = request.num_tokens + num_placeholders - num_computed
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            # The sampled token must land below max_model_len; only a prompt of exactly
            # max_model_len tokens may still be computed whole (it then ends LENGTH_CAPPED).
            if num_new_tokens > max_len_cap - num_computed:
                num_new_tokens = max(max_len_cap, request.num_prompt_tokens) - num_computed
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while (new_blocks := allocate_slots(request, num_new_tokens)) is None:
                # Preempt by recompute until the request fits, or it is the victim itself.
                if self.policy is SchedulingPolicy.PRIORITY:
                    victim_index = max(
                        range(len(running)),
                        key=lambda i: (running[i].priority, running[i].arrival_time),
                    )
                    victim = running.pop(victim_index)
                    if victim_index < req_index:
                        req_index -= 1
                    if victim.request_id in num_scheduled_tokens:
                        # Already scheduled this step: it gives its tokens back.
                        scheduled_running_reqs.remove(victim)
                        token_budget += num_scheduled_tokens.pop(victim.request_id)
                        del req_to_new_blocks[victim.request_id]
                else:
                    victim = running.pop()
                self._preempt_request(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # 2. Waiting requests, unless this step preempted: what was just freed goes to the
        # preempted requests first, not to newcomers.
        if not preempted:
            token_budget = self._schedule_waiting(
                token_budget, num_scheduled_tokens, scheduled_new_reqs, scheduled_resumed_reqs
            )
        assert token_budget >= 0 and len(self.running) <= self.max_num_running_reqs
        return self._make_output(
            num_scheduled_tokens,
            req_to_new_blocks,
            scheduled_running_reqs,
            scheduled_new_reqs,
            scheduled_resumed_reqs,
        )

    def _schedule_waiting(
        self,
        token_budget: int,
        num_scheduled_tokens: dict[str, int],
        scheduled_new_reqs: list[Request],
        scheduled_resumed_reqs: list[Request],
    ) -> int:
        """Admit waiting requests while budget, seats and blocks last; returns the budget left."""
        kv_cache_manager = self.kv_cache_manager
        reserved_blocks = self._num_reserved_blocks()
        step_skipped = create_request_queue(self.policy)
        while (self.waiting or self.skipped_waiting) and token_budget > 0:
            if len(self.running) >= self.max_num_running_reqs:
                break
            queue = self._select_waiting_queue()
            request = queue.peek_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self._update_waiting_for_remote_kv(request):
                    step_skipped.add_request(queue.pop_request())
                    continue

            match = self._match_computed_tokens(request)
            if match is None:  # the connector cannot tell yet: ask next step
                step_skipped.add_request(queue.pop_request())
                continue
            new_computed_blocks, num_local_computed, num_external_tokens, load_kv_async = match
            num_computed_tokens = request.num_computed_tokens + num_local_computed
            num_computed_tokens += num_external_tokens
            num_new_tokens = 0
            if not load_kv_async:
                num_new_tokens = request.num_tokens - num_computed_tokens
                if num_new_tokens > token_budget:
                    if not self.enable_chunked_prefill:
                        break  # the prompt waits for a step with room for all of it
                    num_new_tokens = token_budget
                assert num_new_tokens > 0
            # Parked loads keep their blocks to come free (minus this request's own). An async
            # load is admitted only if the rest of its prompt fits too: two loads that each hold
            # part of the pool could otherwise wait for each other's blocks forever.
            own_reserved = self._num_blocks_to_complete(request)
            margin = self._num_blocks_short(request, num_computed_tokens) if load_kv_async else 0
            new_blocks = kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_local_computed,
                new_computed_blocks=new_computed_blocks,
                num_external_computed_tokens=num_external_tokens,
                delay_cache_blocks=load_kv_async,
                reserved_blocks=reserved_blocks - own_reserved + margin,
            )
            if new_blocks is None:
                break  # waiting requests never preempt
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request, kv_cache_manager.get_blocks(request.request_id), num_external_tokens
                )
            queue.pop_request()
            reserved_blocks += margin - own_reserved
            if load_kv_async:
                # Parked until the worker reports the transfer done; counted as computed now.
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                request.num_computed_tokens = num_computed_tokens
                step_skipped.add_request(request)
                continue

            self.running.append(request)
            if request.status == RequestStatus.WAITING:
                scheduled_new_reqs.append(request)
            elif request.status == RequestStatus.PREEMPTED:
                scheduled_resumed_reqs.append(request)
            else:
                raise RuntimeError(f"Invalid request status: {request.status!r}")
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed_tokens
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        if step_skipped:
            self.skipped_waiting.prepend_requests(step_skipped)
        return token_budget

    def _preempt_request(self, request: Request) -> None:
        """Recompute preemption: drop the blocks (their hashes stay cached) and queue it first."""
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Async: it resumes from the tokens known now; its steps in flight sample for nothing.
        request.num_async_tokens_to_discard += request.num_output_placeholders
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)
        self.reset_preempted_req_ids.add(request.request_id)
        logger.debug("Preempted request %s.", request.request_id)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Finished ids not yet sent to the workers: one more step must carry them."""
        return len(self.finished_req_ids) > 0

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.skipped_waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            num_free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            num_blocks=self.kv_cache_manager.block_pool.num_blocks,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
