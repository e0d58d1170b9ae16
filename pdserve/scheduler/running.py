"""Step 1 of schedule(): the running requests' tokens and new blocks, in admission order,
preempting by recompute where the blocks run out.

Decodes and unfinished prefill chunks alike: each gets the tokens that take it to every token
it has, as far as the budget lasts; step 2 (admission.py) admits waiting requests with the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from pdserve.request import Request, RequestStatus
from pdserve.scheduler.drafts import Drafter
from pdserve.scheduler.kv_cache_manager import KVCacheManager
from pdserve.scheduler.request_queue import SchedulingPolicy, select_victim


class RunningSchedule(NamedTuple):
    num_scheduled_tokens: dict[str, int]  # in running order; the admissions add theirs after
    # Running requests that got new blocks: their row in num_scheduled_tokens, the ids.
    new_block_ids: dict[str, tuple[int, list[int]]]
    scheduled_reqs: list[Request]  # the running requests that got tokens, in order
    reach_all_tokens: bool  # every running request scheduled got all its tokens
    preempted: bool  # the victims are still in `running`, no longer RUNNING
    token_budget: int  # what is left for the waiting requests
    spec_token_ids: dict[str, list[int]]  # the drafts each decode verifies (speculation)


def cut_short(num_computed_tokens: int, num_new_tokens: int, alignment: int) -> int:
    """The tokens of a step the budget cuts short of the request's end: up to a multiple of
    `alignment` (a model whose prompt chunks must not split: Qwen3.5's DeltaNet), maybe 0."""
    return (num_computed_tokens + num_new_tokens) // alignment * alignment - num_computed_tokens


def schedule_running(
    running: list[Request],
    token_budget: int,
    kv_cache_manager: KVCacheManager,
    policy: SchedulingPolicy,
    preempt: Callable[[Request], None],
    alignment: int = 1,
    drafter: Drafter | None = None,
) -> RunningSchedule:
    """Victims of preemption stay in `running` (the caller drops them once this returns).
    With a `drafter`, a decode takes its drafts too (scheduler/drafts.py)."""
    num_scheduled_tokens: dict[str, int] = {}
    spec_token_ids: dict[str, list[int]] = {}
    new_block_ids: dict[str, tuple[int, list[int]]] = {}
    preempted = positions_moved = False
    reach_all_tokens = True
    allocate_slots = kv_cache_manager.allocate_slots
    running_status = RequestStatus.RUNNING
    for request in running:
        if preempted and request.status != running_status:
            continue
        num_tokens = request.num_tokens
        if num_placeholders := request.num_output_placeholders:
            # Placeholders count as tokens: the runner feeds the one it sampled itself. So do
            # the drafts in flight, as if all were accepted (their step rolls back the rest).
            num_tokens += num_placeholders + request.num_draft_tokens
            if num_tokens >= request.max_num_tokens:
                # The steps in flight already sample the last token the request may have.
                continue
            if request.structured_output is not None:
                # Its next mask depends on the token in flight: it waits for it.
                continue
        # At least 1: every step leaves a running request a token to compute (a placeholder
        # when it sampled). No sampled token passes max_model_len: a request ends at
        # max_num_tokens <= max_model_len, and the check above keeps steps in flight from
        # sampling past it (a prompt of max_model_len tokens is computed whole, then ends).
        num_new_tokens = num_tokens - request.num_computed_tokens
        drafts = None
        if drafter is not None and num_new_tokens == 1:
            drafts = drafter.propose(request, token_budget - 1, num_tokens)
            num_new_tokens += len(drafts)
            num_tokens += len(drafts)
        if num_new_tokens > token_budget:
            num_new_tokens = cut_short(request.num_computed_tokens, token_budget, alignment)
            reach_all_tokens = False
            if num_new_tokens <= 0:
                continue
            num_tokens = request.num_computed_tokens + num_new_tokens
        if num_tokens >= request.next_kv_boundary:
            # Below the boundary (most decode steps) allocate_slots would do nothing.
            while (new_blocks := allocate_slots(request, num_new_tokens)) is None:
                # Preempt by recompute until the request fits, or it is the victim itself.
                victim = select_victim(running, policy)
                if victim.request_id in num_scheduled_tokens:
                    # Already scheduled this step: it gives its tokens back.
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id, None)
                    spec_token_ids.pop(victim.request_id, None)
                    positions_moved = True
                preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            if new_blocks:
                new_block_ids[request.request_id] = (
                    len(num_scheduled_tokens),
                    [b.block_id for b in new_blocks],
                )
        num_scheduled_tokens[request.request_id] = num_new_tokens
        token_budget -= num_new_tokens
        if drafts:
            spec_token_ids[request.request_id] = drafts
            request.num_draft_tokens += len(drafts)
    if positions_moved:  # a victim left num_scheduled_tokens: the rows after it moved up
        rows = {req_id: i for i, req_id in enumerate(num_scheduled_tokens)}
        new_block_ids = {r: (rows[r], ids) for r, (_, ids) in new_block_ids.items()}
    # Usually every running request got tokens (once the budget is spent, the rest get 0).
    if len(num_scheduled_tokens) == len(running):
        scheduled_reqs = running.copy()
    else:
        scheduled_reqs = [r for r in running if r.request_id in num_scheduled_tokens]
    return RunningSchedule(
        num_scheduled_tokens,
        new_block_ids,
        scheduled_reqs,
        reach_all_tokens,
        preempted,
        token_budget,
        spec_token_ids,
    )
