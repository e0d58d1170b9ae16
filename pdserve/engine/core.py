"""EngineCore: the step loop that ties scheduler and executor together.

With `max_concurrent_batches` > 1 (async scheduling, or pipeline stages) steps go through a
batch queue: the engine schedules and submits steps while the workers compute earlier ones,
and processes each step's output in submission order (vLLM's `step_with_batch_queue`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pdserve.config import EngineConfig
from pdserve.core_board import instance_board
from pdserve.distributed.kv_events import make_event_publisher, new_batch
from pdserve.engine.input_processor import check_prompt
from pdserve.engine.messages import EngineCoreRequest
from pdserve.executor.base import Executor
from pdserve.kv_connector.factory import create_scheduler_connector
from pdserve.outputs import EngineCoreOutput, ModelRunnerOutput
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.scheduler import Scheduler
from pdserve.scheduler.stats import SchedulerStats
from pdserve.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from pdserve.kv_transfer_params import KVTransferParams

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = Executor.get_class(config)(config)
        try:
            self.num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_kv_cache(self.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        # The engine's one handle on the connector's scheduler half (the no-op one without a
        # connector): callers outside go through EngineCore's methods.
        self.kv_connector = create_scheduler_connector(config)
        try:
            # Each rank's answer to a peer's handshake; the connector serves them.
            payloads = self.executor.collective_rpc("get_kv_connector_handshake_metadata")
            self.kv_connector.set_xfer_handshake_metadata(dict(enumerate(payloads)))
        except BaseException:
            self.executor.shutdown()
            raise
        try:
            self.kv_events = make_event_publisher(config.kv_events_config)
        except BaseException:
            self.executor.shutdown()
            self.kv_connector.shutdown()
            raise
        self.structured_output = StructuredOutputManager(
            config.model_config, config.scheduler_config.max_num_seqs
        )
        # Constrained requests whose grammar is still compiling, in arrival order.
        self.waiting_for_grammar: dict[str, Request] = {}
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            config.model_config.max_model_len,
            self.num_blocks,
            config.use_v2_model_runner,
            kv_connector=self.kv_connector,
            enable_kv_cache_events=self.kv_events.publishes,
            structured_output=self.structured_output,
            has_state=config.model_config.has_inner_state,
            prompt_chunk_alignment=config.model_config.prompt_chunk_alignment,
            speculative_config=config.speculative_config,
        )
        self.batch_queue_size = self.executor.max_concurrent_batches
        # False when the last step had nothing to compute (only transfers to poll).
        self.last_step_scheduled = False
        # Steps submitted and not yet processed, newest first.
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        self.cores = instance_board(config.parallel_config.world_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        mc = self.config.model_config
        check_prompt(
            request.prompt_token_ids + request.output_token_ids, mc.vocab_size, mc.max_model_len
        )
        engine_request = request.to_request()
        # Refused here, not when its grammar is ready: the scheduler's refusal then would end
        # the engine. An id in use may still be the scheduler's after its client went away.
        request_id = engine_request.request_id
        if request_id in self.waiting_for_grammar or request_id in self.scheduler.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if engine_request.sampling_params.structured_outputs is None:
            self.scheduler.add_request(engine_request)
            return
        self.structured_output.grammar_init(engine_request)
        self.waiting_for_grammar[engine_request.request_id] = engine_request

    def _schedule_compiled(self) -> list[EngineCoreOutput]:
        """Hand the requests whose grammar is ready to the scheduler; those whose grammar
        failed end with an error."""
        failed = []
        for req_id, request in list(self.waiting_for_grammar.items()):
            try:
                if not request.structured_output.compiled(request):  # type: ignore[union-attr]
                    continue
            except ValueError as e:
                failed.append(
                    EngineCoreOutput(
                        req_id, [], finish_reason=int(FinishReason.ERROR), error=str(e)
                    )
                )
            else:
                self.scheduler.add_request(request)
            del self.waiting_for_grammar[req_id]
        return failed

    def abort_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        request_ids = list(request_ids)
        if self.waiting_for_grammar:
            for req_id in request_ids:
                self.waiting_for_grammar.pop(req_id, None)
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.waiting_for_grammar)

    def _has_work(self) -> bool:
        # A step also runs to tell the workers which requests finished since the last one, and
        # to poll the connector's transfers.
        return (
            self.has_unfinished_requests()
            or self.scheduler.has_finished_requests()
            or self.has_pending_transfers()
        )

    def has_work(self) -> bool:
        """False only when a step would do nothing: the engine loop may then block."""
        return self._has_work() or bool(self.batch_queue)

    def has_pending_transfers(self) -> bool:
        """KV transfers in flight or blocks held for a reader: the workers must be polled."""
        return self.kv_connector.has_pending_transfers()

    def get_stats(self) -> tuple[SchedulerStats, dict[str, float] | None]:
        """The scheduler's gauges and the connector's cumulative counters (None without one)."""
        return self.scheduler.make_stats(), self.kv_connector.get_stats()

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def _publish_kv_events(self) -> None:
        events = self.scheduler.take_kv_cache_events()
        if events:
            self.kv_events.publish(new_batch(events))

    def release_remote_kv(self, request_id: str, params: KVTransferParams) -> bool:
        """Let a prefill instance free the KV a request here will never read; False when this
        instance has no connector to reach it with."""
        return self.kv_connector.release_remote(request_id, params)

    def step(self) -> list[EngineCoreOutput]:
        # While this instance computes nothing (no request, or only requests that wait for a
        # peer's KV: a push-mode decode instance while its prefill instance computes), the
        # others on its host may use its cores.
        self.cores.mark(self.scheduler.has_requests_to_compute())
        failed = self._schedule_compiled() if self.waiting_for_grammar else []
        outputs = self.step_with_batch_queue() if self.batch_queue_size > 1 else self._step()
        if failed:
            outputs = failed + outputs
        self._publish_kv_events()
        self.cores.mark(self.scheduler.has_requests_to_compute())
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        if not self._has_work():
            return []
        scheduler_output = self.scheduler.schedule()
        self.last_step_scheduled = scheduler_output.total_num_scheduled_tokens > 0
        model_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Submit a step; process the oldest only once the queue is full, nothing more can be
        scheduled, or it is already done (then waiting gains nothing).

        Returns [] while steps are only submitted: the caller steps again.
        """
        queue = self.batch_queue
        if self._has_work():
            scheduler_output = self.scheduler.schedule()
            self.last_step_scheduled = scheduler_output.total_num_scheduled_tokens > 0
            future = self.executor.execute_model(scheduler_output, non_block=True)
            assert isinstance(future, Future)
            queue.appendleft((future, scheduler_output))
            if (
                scheduler_output.total_num_scheduled_tokens > 0
                and len(queue) < self.batch_queue_size
                and not queue[-1][0].done()
            ):
                return []
        elif not queue:
            return []
        future, scheduler_output = queue.pop()
        return self.scheduler.update_from_output(scheduler_output, future.result())

    def shutdown(self) -> None:
        self.batch_queue.clear()
        self.executor.shutdown()
        self.kv_connector.shutdown()
        self.kv_events.shutdown()
        self.structured_output.shutdown()
