"""The SchedulerOutput of a step, a pure function of the step's decisions; runner V1 and
runner V2 differ only here.

A request resumed after preemption goes to runner V2 as a new request carrying every token so
far (V2 dropped its row when it saw the id in `preempted_req_ids`), and to runner V1 as a
cached request whose block table is replaced (V1 kept its state). See docs/runners.md.

Nothing here changes a request: the Scheduler advances them after the output is built
(`Scheduler._update_after_schedule`), so the output holds the numbers from before the step.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from pdserve.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from pdserve.scheduler.step import StepDecisions


def build_scheduler_output(
    step: StepDecisions,
    use_v2_model_runner: bool,
    get_block_ids: Callable[[str], list[int]],
    finished_req_ids: set[str],
    preempted_req_ids: set[str],
    prev_step_scheduled_req_ids: Container[str],
    running_all_in_prev_step: bool,
) -> SchedulerOutput:
    """The message for the workers (its connector metadata is the Scheduler's to add).

    Runner V1 needs the ids the previous step scheduled; `running_all_in_prev_step` says that
    every running request was among them (the usual case, which needs no lookups).
    """
    running_reqs = step.running_reqs
    resumed_reqs = step.resumed_reqs
    if use_v2_model_runner:
        # Runner V2 dropped a preempted request's row: it gets the request anew, with
        # every token so far to prefill.
        new_reqs_data = [
            NewRequestData.from_request(r, get_block_ids(r.request_id), r.all_token_ids.copy())
            for r in step.new_reqs + resumed_reqs
        ]
        resumed_reqs = []
    else:
        # A new request with tokens past its prompt continues from a token another instance
        # sampled (kv_connector/first_token.py): runner V1 needs those too.
        new_reqs_data = [
            NewRequestData.from_request(
                r,
                get_block_ids(r.request_id),
                r.all_token_ids.copy() if r.num_tokens > r.num_prompt_tokens else None,
            )
            for r in step.new_reqs
        ]

    # Struct of lists, built with comprehensions: this runs for every running request.
    req_ids = step.req_ids[: len(running_reqs)]
    new_block_ids: list[list[int] | None] = [None] * len(req_ids)
    for row, block_ids in step.new_block_ids.values():
        new_block_ids[row] = block_ids
    num_computed_tokens = [r.num_computed_tokens for r in running_reqs]
    num_output_tokens = [
        r.num_tokens - r.num_prompt_tokens + r.num_output_placeholders for r in running_reqs
    ]
    all_token_ids: dict[str, list[int]] = {}
    if not use_v2_model_runner and not running_all_in_prev_step:
        # A request with steps in flight (more than one with pipeline stages) is behind the
        # runner, which appended the tokens they sampled: its known tokens would cut them.
        all_token_ids = {
            r.request_id: r.all_token_ids.copy()
            for r in running_reqs
            if r.request_id not in prev_step_scheduled_req_ids and not r.num_output_placeholders
        }
    for request in resumed_reqs:
        # Runner V1 kept the request's state: its block table is replaced whole.
        req_id = request.request_id
        req_ids.append(req_id)
        new_block_ids.append(get_block_ids(req_id))
        num_computed_tokens.append(request.num_computed_tokens)
        num_output_tokens.append(request.num_output_tokens)
        if req_id not in prev_step_scheduled_req_ids:
            all_token_ids[req_id] = request.all_token_ids.copy()
    cached = CachedRequestData(
        req_ids=req_ids,
        resumed_req_ids={r.request_id for r in resumed_reqs},
        all_token_ids=all_token_ids,
        new_block_ids=new_block_ids,
        num_computed_tokens=num_computed_tokens,
        num_output_tokens=num_output_tokens,
    )
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs_data,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=step.num_scheduled_tokens,
        total_num_scheduled_tokens=step.total_num_scheduled_tokens,
        finished_req_ids=finished_req_ids,
        preempted_req_ids=preempted_req_ids if use_v2_model_runner else None,
    )
