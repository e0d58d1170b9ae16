"""Building the SchedulerOutput of a step, where runner V1 and runner V2 differ.

A request resumed after preemption goes to runner V2 as a new request carrying every token so
far (V2 dropped its row when it saw the id in `preempted_req_ids`), and to runner V1 as a
cached request whose block table is replaced (V1 kept its state). See docs/runners.md.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.request import Request
from pdserve.scheduler.block_pool import KVCacheBlock
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput


class SchedulerOutputBuilderMixin:
    """Part of `Scheduler`: turns one step's decisions into the message for the workers."""

    requests: dict[str, Request]
    kv_cache_manager: KVCacheManager
    connector: Any | None
    use_v2_model_runner: bool
    max_num_scheduled_tokens: int
    finished_req_ids: set[str]
    reset_preempted_req_ids: set[str]
    prev_step_scheduled_req_ids: set[str]

    def _make_output(
        self,
        num_scheduled_tokens: dict[str, int],
        req_to_new_blocks: dict[str, list[KVCacheBlock]],
        scheduled_running_reqs: list[Request],
        scheduled_new_reqs: list[Request],
        scheduled_resumed_reqs: list[Request],
    ) -> SchedulerOutput:
        get_block_ids = self.kv_cache_manager.get_block_ids
        v2 = self.use_v2_model_runner
        if v2:
            # Runner V2 dropped a preempted request's row: it gets the request anew, with
            # every token so far to prefill.
            new_reqs_data = [
                NewRequestData.from_request(r, get_block_ids(r.request_id), r.all_token_ids.copy())
                for r in scheduled_new_reqs + scheduled_resumed_reqs
            ]
            scheduled_resumed_reqs = []
        else:
            new_reqs_data = [
                NewRequestData.from_request(r, get_block_ids(r.request_id))
                for r in scheduled_new_reqs
            ]

        # Struct of lists, built with comprehensions: this runs for every running request.
        running_ids = [r.request_id for r in scheduled_running_reqs]
        new_block_ids = [
            [b.block_id for b in blocks] if (blocks := req_to_new_blocks[req_id]) else None
            for req_id in running_ids
        ]
        num_computed_tokens = [r.num_computed_tokens for r in scheduled_running_reqs]
        num_output_tokens = [
            r.num_output_tokens + r.num_output_placeholders for r in scheduled_running_reqs
        ]
        all_token_ids: dict[str, list[int]] = {}
        prev_step_ids = self.prev_step_scheduled_req_ids
        if not v2:
            # A request with steps in flight (more than one with pipeline stages) is behind the
            # runner, which appended the tokens they sampled: its known tokens would cut them.
            all_token_ids = {
                r.request_id: r.all_token_ids.copy()
                for r in scheduled_running_reqs
                if r.request_id not in prev_step_ids and not r.num_output_placeholders
            }
        for request in scheduled_resumed_reqs:
            # Runner V1 kept the request's state: its block table is replaced whole.
            req_id = request.request_id
            running_ids.append(req_id)
            new_block_ids.append(get_block_ids(req_id))
            num_computed_tokens.append(request.num_computed_tokens)
            num_output_tokens.append(request.num_output_tokens)
            if req_id not in prev_step_ids:
                all_token_ids[req_id] = request.all_token_ids.copy()
        cached = CachedRequestData(
            req_ids=running_ids,
            resumed_req_ids={r.request_id for r in scheduled_resumed_reqs},
            new_token_ids=[],
            all_token_ids=all_token_ids,
            new_block_ids=new_block_ids,
            num_computed_tokens=num_computed_tokens,
            num_output_tokens=num_output_tokens,
        )

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.reset_preempted_req_ids if v2 else None,
        )
        if self.connector is not None:
            scheduler_output.kv_connector_metadata = msgspec.msgpack.encode(
                self.connector.build_connector_meta(scheduler_output)
            )
        assert scheduler_output.total_num_scheduled_tokens <= self.max_num_scheduled_tokens

        # The output holds the numbers from before this step; now the step is taken as done.
        requests = self.requests
        for req_id, num_tokens in num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += num_tokens
            # A step that reaches every token, known or in flight, samples one more.
            if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        if not v2:
            self.prev_step_scheduled_req_ids = set(num_scheduled_tokens)
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()
        return scheduler_output
