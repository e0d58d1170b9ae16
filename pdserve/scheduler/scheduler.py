"""The scheduler: which requests run this step, how many tokens each, and what came out of it.

Each step hands out a token budget so that every request's `num_computed_tokens` catches up
with its `num_tokens`, running requests first, then waiting ones (vLLM V1). One class owns
schedule(), update_from_output(), finish_requests() and preemption; the helpers it composes own
their state (KV cache manager, request queues, parked remote-KV requests, waiting admission),
and the running requests' share of a step is a function of them (running.py).
The SchedulerOutput is a pure function of the step's decisions, and `_update_after_schedule`
advances the requests after it. Async scheduling: a step that samples leaves a placeholder
token that the next schedule() counts (docs/async_scheduling.md).
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.config.speculative import SpeculativeConfig
from pdserve.distributed.kv_events import KVCacheEvent
from pdserve.kv_connector.base import KVConnectorScheduler
from pdserve.kv_connector.noop import NoKVConnectorScheduler
from pdserve.outputs import EngineCoreOutput, KVConnectorOutput, ModelRunnerOutput
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.scheduler.admission import Admissions, WaitingAdmission
from pdserve.scheduler.drafts import Drafter, keep_proposals, roll_back_rejected
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.output_builder import build_scheduler_output
from pdserve.scheduler.remote_kv import RemoteKVRequests
from pdserve.scheduler.request_queue import SchedulingPolicy, create_request_queue
from pdserve.scheduler.running import schedule_running
from pdserve.scheduler.sampled_tokens import (
    apply_sampled_tokens,
    attach_logprobs,
    attach_prompt_logprobs,
    sampled_rows,
)
from pdserve.scheduler.stats import SchedulerStats, SpecDecodingStats
from pdserve.scheduler.step import StepDecisions, StepsInFlight, advance_requests

if TYPE_CHECKING:
    from pdserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        use_v2_model_runner: bool,
        kv_connector: KVConnectorScheduler | None = None,
        enable_kv_cache_events: bool = False,
        structured_output: StructuredOutputManager | None = None,
        has_state: bool = False,
        prompt_chunk_alignment: int = 1,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.max_model_len = max_model_len
        # Structured outputs: the bitmask of each step's constrained requests comes from it.
        self.structured_output = structured_output
        self.num_structured_reqs = 0
        self.use_v2_model_runner = use_v2_model_runner
        # The no-op connector stands in for none, so no step asks whether there is one.
        self.connector = kv_connector or NoKVConnectorScheduler()
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        # EngineConfig resolves the budget; a bare SchedulerConfig gets the same default.
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens or (
            2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        )
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.drafter = None if speculative_config is None else Drafter(speculative_config)
        self.spec_stats = SpecDecodingStats()
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            max_model_len,
            cache_config.enable_prefix_caching,
            enable_kv_cache_events,
            num_lookahead_tokens=0 if self.drafter is None else self.drafter.num_lookahead_tokens,
        )
        self.remote_kv = RemoteKVRequests(
            self.policy,
            self.kv_cache_manager,
            self.connector,
            has_state,
        )
        self.admission = WaitingAdmission(
            self.kv_cache_manager,
            self.remote_kv,
            self.connector,
            self.policy,
            self.enable_chunked_prefill,
            prompt_chunk_alignment,
        )

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Ids finished / preempted since the last step. Rebound (never cleared) after each
        # schedule(): the SchedulerOutput just built holds the old set objects.
        self.finished_req_ids: set[str] = set()
        self.reset_preempted_req_ids: set[str] = set()
        # Runner V1 only: requests not scheduled in the previous step get all their tokens.
        # The previous step's num_scheduled_tokens stands for its ids (nothing changes it once
        # built); usually every running request was among them, which needs no lookups.
        self.prev_step_scheduled_req_ids: Container[str] = {}
        self.running_all_in_prev_step = True
        self.num_preemptions = 0
        # The requests of each step in flight, in num_scheduled_tokens order, so that
        # update_from_output need not look each one up. Steps end in the order they started;
        # more than a few in flight fall back to the lookups.
        self._steps_in_flight = StepsInFlight()

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        # The engine rejects prompts longer than max_model_len before they get here.
        assert request.num_prompt_tokens <= self.max_model_len, "prompt longer than max_model_len"
        self.requests[request.request_id] = request
        if request.structured_output is not None:
            assert self.structured_output is not None, "a constrained request needs the manager"
            self.num_structured_reqs += 1
        # One comparison in the stop check covers both length limits.
        request.max_num_tokens = min(request.max_num_tokens, self.max_model_len)
        self.connector.on_new_request(request)
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.remote_kv.add(request)
        else:
            self.waiting.add_request(request)

    def schedule(self) -> SchedulerOutput:
        # 1. Running requests, in admission order: decodes and unfinished prefill chunks alike.
        ran = schedule_running(
            self.running,
            self.max_num_scheduled_tokens,
            self.kv_cache_manager,
            self.policy,
            self._preempt_request,
            self.admission.alignment,
            self.drafter,
        )
        num_scheduled_tokens = ran.num_scheduled_tokens
        running = self.running

        # 2. Waiting requests, unless this step preempted: what was just freed goes to the
        # preempted requests first, not to newcomers.
        admissions = Admissions([], [], [], ran.token_budget)
        if ran.preempted:  # its victims leave the running list
            self.running = running = [r for r in running if r.status == RequestStatus.RUNNING]
        elif self.waiting or self.remote_kv:
            admissions = self.admission.admit(
                self.waiting,
                ran.token_budget,
                self.max_num_running_reqs - len(running),
                num_scheduled_tokens,
            )
            running += admissions.admitted
        token_budget = admissions.token_budget
        assert token_budget >= 0 and len(running) <= self.max_num_running_reqs

        step = StepDecisions(
            num_scheduled_tokens=num_scheduled_tokens,
            req_ids=list(num_scheduled_tokens),
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - token_budget,
            running_reqs=ran.scheduled_reqs,
            running_reqs_reach_all_tokens=ran.reach_all_tokens,
            new_block_ids=ran.new_block_ids,
            admitted_reqs=admissions.admitted,
            new_reqs=admissions.new_reqs,
            resumed_reqs=admissions.resumed_reqs,
        )
        scheduler_output = build_scheduler_output(
            step,
            self.use_v2_model_runner,
            self.kv_cache_manager.get_block_ids,
            self.finished_req_ids,
            self.reset_preempted_req_ids,
            self.prev_step_scheduled_req_ids,
            self.running_all_in_prev_step,
        )
        if ran.spec_token_ids:
            scheduler_output.scheduled_spec_decode_tokens = ran.spec_token_ids
        if self.drafter is not None:
            scheduler_output.draft_paused_req_ids = self.drafter.end_step()
        scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
            scheduler_output
        )
        scheduled_reqs = step.scheduled_reqs
        self._update_after_schedule(step, scheduled_reqs)
        if self.num_structured_reqs:
            # After the advance: a placeholder marks each request that samples this step.
            scheduler_output.grammar_bitmask = self.structured_output.grammar_bitmask(  # type: ignore[union-attr]
                scheduled_reqs, ran.spec_token_ids
            )
        self._steps_in_flight.push(scheduler_output, scheduled_reqs, step.req_ids)
        return scheduler_output

    def _update_after_schedule(self, step: StepDecisions, scheduled_reqs: list[Request]) -> None:
        """The output holds the numbers from before this step; now the step is taken as done."""
        advance_requests(step, scheduled_reqs)
        if not self.use_v2_model_runner:
            self.prev_step_scheduled_req_ids = step.num_scheduled_tokens
            self.running_all_in_prev_step = len(scheduled_reqs) == len(self.running)
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    def _preempt_request(self, request: Request) -> None:
        """Recompute preemption: drop the blocks (their hashes stay cached) and queue it first."""
        assert request.status == RequestStatus.RUNNING
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Async: it resumes from the tokens known now; its steps in flight sample for nothing.
        request.num_async_tokens_to_discard += request.num_output_placeholders
        request.num_output_placeholders = 0
        request.num_draft_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)
        self.reset_preempted_req_ids.add(request.request_id)
        logger.debug("Preempted request %s.", request.request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, finish the requests they end, and report both.

        Async scheduling: each token replaces a placeholder. Tokens of requests that finished
        while the step was in flight, and of requests preempted since, are dropped.
        """
        if scheduler_output.scheduled_spec_decode_tokens:
            roll_back_rejected(
                scheduler_output.scheduled_spec_decode_tokens,
                model_runner_output,
                self.requests,
                self.drafter,
                self.spec_stats,
            )
        if model_runner_output.draft_token_ids:
            keep_proposals(model_runner_output, self.requests)
        rows = sampled_rows(
            self._steps_in_flight.pop(scheduler_output),
            scheduler_output.num_scheduled_tokens,
            model_runner_output,
            self.requests,
        )
        outputs, stopped = apply_sampled_tokens(rows, self.kv_cache_manager, self.max_model_len)
        if stopped:
            for request, output in stopped:
                output.kv_transfer_params = self._free_request(request)
            ended = {request for request, _ in stopped}
            self.running = [r for r in self.running if r not in ended]
        if model_runner_output.logprobs is not None:
            attach_logprobs(outputs, model_runner_output)
        if model_runner_output.prompt_logprobs_dict:
            attach_prompt_logprobs(outputs, model_runner_output.prompt_logprobs_dict)
        if model_runner_output.kv_connector_output is not None:
            outputs += self._update_from_kv_xfer_finished(model_runner_output.kv_connector_output)
        return outputs

    def _update_from_kv_xfer_finished(
        self, kv_connector_output: KVConnectorOutput
    ) -> list[EngineCoreOutput]:
        """Act on the transfers the workers finished; returns the outputs of requests whose
        load failed."""
        to_free, failed = self.remote_kv.update_from_kv_xfer_finished(
            kv_connector_output, self.requests
        )
        for request in to_free:
            self._free_blocks(request)
        outputs = []
        for request, worker_done, reason in failed:
            request.status = RequestStatus.FINISHED_ERROR
            self._free_request(request, delay_free_blocks=not worker_done)
            outputs.append(
                EngineCoreOutput(
                    request.request_id, [], finish_reason=int(FinishReason.ERROR), error=reason
                )
            )
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
            self.remote_kv.remove(waiting)
        for request in to_finish:
            delay_free_blocks = False
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                delay_free_blocks = self.remote_kv.finish(request)
            request.status = finished_status
            self._free_request(request, delay_free_blocks)

    def _free_request(
        self, request: Request, delay_free_blocks: bool = False
    ) -> dict[str, Any] | None:
        """Finish a request; its blocks wait if the connector still sends (or receives) them."""
        assert request.is_finished()
        if request.structured_output is not None:
            self.num_structured_reqs -= 1
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

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.remote_kv) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests_to_compute(self) -> bool:
        """Whether a step may run the model: requests that only wait for a peer's KV (parked,
        or queued to load it) need no core until it arrived."""
        return bool(
            self.running
            or self.remote_kv.finished_recving_kv_req_ids
            or any(
                r.kv_transfer_params is None or not r.kv_transfer_params.do_remote_prefill
                for r in self.waiting
            )
        )

    def has_finished_requests(self) -> bool:
        """Finished ids not yet sent to the workers: one more step must carry them."""
        return len(self.finished_req_ids) > 0

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.remote_kv),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            num_free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            num_blocks=self.kv_cache_manager.block_pool.num_blocks,
            # A snapshot: the admission goes on counting into its own.
            prompt_tokens_by_source=msgspec.structs.replace(self.admission.prompt_token_sources),
            spec_decoding=None
            if self.drafter is None
            else msgspec.structs.replace(
                self.spec_stats, accepted_per_position=list(self.spec_stats.accepted_per_position)
            ),
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        return self.kv_cache_manager.block_pool.take_events()
