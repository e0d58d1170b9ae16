"""One step as schedule() decided it, the requests' advance once it is built, and the steps
still in flight."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pdserve.request import Request
from pdserve.scheduler.output import SchedulerOutput


@dataclass(slots=True)
class StepDecisions:
    """What schedule() decided for one step."""

    num_scheduled_tokens: dict[str, int]
    req_ids: list[str]  # num_scheduled_tokens' keys
    total_num_scheduled_tokens: int
    # Running requests that got tokens, in order (the first keys of num_scheduled_tokens);
    # for those that got new blocks, their row there and the block ids.
    running_reqs: list[Request]
    running_reqs_reach_all_tokens: bool  # none was cut short by the budget
    new_block_ids: dict[str, tuple[int, list[int]]]
    # Admitted from the waiting queue, in order (the other keys); split into first time and
    # back after preemption.
    admitted_reqs: list[Request]
    new_reqs: list[Request]
    resumed_reqs: list[Request]

    @property
    def scheduled_reqs(self) -> list[Request]:
        """Every scheduled request, in num_scheduled_tokens order."""
        return self.running_reqs + self.admitted_reqs if self.admitted_reqs else self.running_reqs


def advance_requests(step: StepDecisions, scheduled_reqs: list[Request]) -> None:
    """Take the step as done: each scheduled request's tokens count as computed, and a request
    the step takes to every token, known or in flight, samples one more (a placeholder)."""
    num_tokens_iter = iter(step.num_scheduled_tokens.values())
    rest = scheduled_reqs
    if step.running_reqs_reach_all_tokens:
        # Each running request got every token it has: each samples. (zip stops at the end of
        # running_reqs, leaving the admitted ones' counts.)
        for request, num_tokens in zip(step.running_reqs, num_tokens_iter):
            request.num_computed_tokens += num_tokens
            request.num_output_placeholders += 1
        rest = step.admitted_reqs
    for request, num_tokens in zip(rest, num_tokens_iter, strict=True):
        num_computed = request.num_computed_tokens + num_tokens
        request.num_computed_tokens = num_computed
        num_ahead = num_computed - request.num_tokens - request.num_draft_tokens
        if num_ahead == request.num_output_placeholders:
            request.num_output_placeholders += 1


class StepsInFlight:
    """The requests (and their ids) of each step whose output has not come back, so that
    processing the output needs no lookup by id. Outputs come back in the order the steps were
    scheduled; a step whose output never comes (a caller that only schedules) is dropped once
    a later one does, and past `maxlen` steps the oldest are forgotten (their outputs fall back
    to lookups)."""

    def __init__(self, maxlen: int = 8) -> None:
        self._steps: deque[tuple[SchedulerOutput, list[Request], list[str]]] = deque(maxlen=maxlen)

    def push(
        self, scheduler_output: SchedulerOutput, scheduled_reqs: list[Request], req_ids: list[str]
    ) -> None:
        self._steps.append((scheduler_output, scheduled_reqs, req_ids))

    def pop(self, scheduler_output: SchedulerOutput) -> tuple[list[Request], list[str]] | None:
        """The requests `scheduler_output` scheduled and their ids, in num_scheduled_tokens
        order; None if it is not a step in flight."""
        steps = self._steps
        for i, (step_output, _, _) in enumerate(steps):
            if step_output is scheduler_output:
                for _ in range(i):
                    steps.popleft()
                _, scheduled_reqs, req_ids = steps.popleft()
                return scheduled_reqs, req_ids
        return None
