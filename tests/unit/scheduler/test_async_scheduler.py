"""Async scheduling in the scheduler: placeholders for tokens in flight, tokens dropped after a
finish or a preemption, the max_tokens skip, and prefix caching over known tokens only.

`AsyncDriver` plays the engine's batch queue: it schedules up to `depth` steps ahead and
processes each step's output in order. The runner it stands for samples, at each position, the
token `position_token` gives; so a request's outputs are the same whatever the timing, and any
token dropped or repeated by mistake shows as a gap or a repeat.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

import pytest

from pdserve.outputs import ModelRunnerOutput
from pdserve.request import Request, RequestStatus
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.scheduler import Scheduler

from .conftest import EOS, make_request, run_to_completion, runner_output

MakeScheduler = Callable[..., Scheduler]
TokenFn = Callable[[Request], int]


def position_token(request: Request) -> int:
    """Right after schedule(), a step that samples covers every token before the sampled one."""
    return 1000 + request.num_computed_tokens


def expected_outputs(request: Request, num_tokens: int) -> list[int]:
    start = 1000 + request.num_prompt_tokens
    return list(range(start, start + num_tokens))


class AsyncDriver:
    def __init__(
        self, scheduler: Scheduler, depth: int = 2, token: TokenFn = position_token
    ) -> None:
        self.scheduler = scheduler
        self.depth = depth
        self.token = token
        self.queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.generated: dict[str, list[int]] = {}

    def schedule(self) -> SchedulerOutput:
        """Schedule a step; its tokens are sampled now, as the runner would, and arrive later."""
        so = self.scheduler.schedule()
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            # Runner V1 replaces its tokens with these: they must reach every position fed.
            if req_id in cached.all_token_ids:
                num_fed = num_computed + so.num_scheduled_tokens[req_id]
                assert len(cached.all_token_ids[req_id]) >= num_fed
        self.queue.append((so, runner_output(self.scheduler, so, self.token)))
        return so

    def process(self) -> None:
        so, out = self.queue.popleft()
        for o in self.scheduler.update_from_output(so, out):
            self.generated.setdefault(o.request_id, []).extend(o.new_token_ids)

    def run_to_completion(self, max_steps: int = 1000) -> dict[str, list[int]]:
        scheduler = self.scheduler
        for _ in range(max_steps):
            if scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
                so = self.schedule()
                if so.total_num_scheduled_tokens > 0 and len(self.queue) < self.depth:
                    continue
            elif not self.queue:
                return self.generated
            self.process()
        raise AssertionError("requests left after max_steps")


def test_placeholders_let_the_next_step_decode(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    a = make_request("a", prompt=8, max_tokens=4)
    scheduler.add_request(a)
    driver = AsyncDriver(scheduler)
    driver.schedule()  # the prefill samples token 8
    assert (a.num_computed_tokens, a.num_output_placeholders) == (8, 1)
    so = driver.schedule()  # token 8 is unknown yet; the runner feeds it from its own state
    assert so.num_scheduled_tokens == {"a": 1}
    cached = so.scheduled_cached_reqs
    assert cached.num_computed_tokens == [8] and cached.num_output_tokens == [1]
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_tokens) == (9, 2, 8)
    driver.process()  # the placeholder becomes token 8
    assert (a.num_output_placeholders, a.output_token_ids) == (1, [1008])
    assert driver.run_to_completion() == {"a": expected_outputs(a, 4)}
    assert a.num_output_placeholders == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_no_step_once_the_steps_in_flight_reach_max_tokens(
    make_scheduler: MakeScheduler, max_tokens: int
) -> None:
    scheduler = make_scheduler()
    a = make_request("a", prompt=5, max_tokens=max_tokens)
    scheduler.add_request(a)
    driver = AsyncDriver(scheduler)
    steps = []
    while scheduler.has_unfinished_requests():
        steps.append(driver.schedule())
        if len(driver.queue) == 2 or steps[-1].total_num_scheduled_tokens == 0:
            driver.process()
    # One prefill and max_tokens - 1 decodes; then a step with nothing to schedule, which
    # waits for the last token instead of sampling one too many.
    num_scheduled = [s.total_num_scheduled_tokens for s in steps]
    assert num_scheduled == [5] + [1] * (max_tokens - 1) + [0]
    driver.run_to_completion()
    assert a.output_token_ids == expected_outputs(a, max_tokens)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED


@pytest.mark.parametrize("depth", [2, 3])
def test_steps_in_flight_stop_at_max_model_len(make_scheduler: MakeScheduler, depth: int) -> None:
    """No step samples a token past max_model_len, with steps in flight as without: the
    request ends there, and no step is scheduled for a position beyond it."""
    scheduler = make_scheduler(max_model_len=12)
    a = make_request("a", prompt=6, max_tokens=None)
    scheduler.add_request(a)
    driver = AsyncDriver(scheduler, depth=depth)
    steps = []
    while scheduler.has_unfinished_requests():
        steps.append(driver.schedule())
        assert a.num_computed_tokens <= 12
        if len(driver.queue) == depth or steps[-1].total_num_scheduled_tokens == 0:
            driver.process()
    driver.run_to_completion()
    assert a.output_token_ids == expected_outputs(a, 6)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sum(s.total_num_scheduled_tokens for s in steps) == 6 + 5


def test_tokens_after_a_stop_are_discarded(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    a = make_request("a", prompt=4, max_tokens=10)
    b = make_request("b", prompt=4, max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)

    def eos_at_6(request: Request) -> int:
        token = position_token(request)
        return EOS if request is a and token == 1006 else token

    driver = AsyncDriver(scheduler, token=eos_at_6)
    driver.schedule()
    driver.schedule()
    driver.process()  # a: 1004
    so = driver.schedule()  # samples a's position 6: EOS
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    driver.process()  # a: 1005
    driver.schedule()  # samples a's position 7, before the EOS is known
    driver.process()  # a: EOS
    assert a.status == RequestStatus.FINISHED_STOPPED and "a" not in scheduler.requests
    assert scheduler.finished_req_ids == {"a"}
    so = driver.schedule()
    assert so.finished_req_ids == {"a"} and "a" not in so.num_scheduled_tokens
    driver.process()  # the token sampled after the EOS is dropped
    generated = driver.run_to_completion()
    assert generated == {"a": [1004, 1005, EOS], "b": expected_outputs(b, 8)}


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
def test_preemption_with_a_step_in_flight(make_scheduler: MakeScheduler, use_v2: bool) -> None:
    scheduler = make_scheduler(num_blocks=4, use_v2_model_runner=use_v2)  # 3 usable blocks
    a = make_request("a", prompt=4, max_tokens=8)
    b = make_request("b", prompt=4, max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    driver = AsyncDriver(scheduler)
    driver.schedule()  # a and b prefill one block each; both sample in flight
    so = driver.schedule()  # a's position 4 takes the last free block; b has none: preempted
    assert so.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED
    assert (b.num_output_placeholders, b.num_async_tokens_to_discard) == (0, 1)
    driver.process()  # b's token from the prefill arrives and is dropped
    assert b.output_token_ids == [] and b.num_async_tokens_to_discard == 0
    assert "b" not in driver.generated

    resumed = None
    while resumed is None:
        so = driver.schedule()
        if "b" in so.num_scheduled_tokens:
            resumed = so
        driver.process()
    # b resumes from the tokens known: its prompt only; the runner forgets its dropped token.
    if use_v2:
        (new,) = resumed.scheduled_new_reqs
        assert new.req_id == "b" and new.prefill_token_ids == b.prompt_token_ids
    else:
        cached = resumed.scheduled_cached_reqs
        assert "b" in cached.resumed_req_ids
        assert cached.all_token_ids["b"] == b.prompt_token_ids
    generated = driver.run_to_completion()
    assert generated == {"a": expected_outputs(a, 8), "b": expected_outputs(b, 3)}
    assert scheduler.make_stats().num_preemptions > 1  # b goes again, with steps in flight


def test_v1_request_skipped_with_a_step_in_flight(make_scheduler: MakeScheduler) -> None:
    """Three steps in flight (pipeline parallelism): a request left out of one step comes back
    while its earlier step still runs. Runner V1 knows more tokens than the scheduler then, and
    must keep them (the driver checks every all_token_ids)."""
    scheduler = make_scheduler(num_blocks=4, policy="priority")  # 3 usable blocks
    x = make_request("x", prompt=7, priority=5, max_tokens=4)
    r = make_request("r", prompt=2, priority=0, max_tokens=4)
    driver = AsyncDriver(scheduler, depth=3)
    scheduler.add_request(x)
    driver.schedule()  # x: 2 blocks
    scheduler.add_request(r)
    driver.schedule()  # x decodes; r: the last block; the pool is full
    so = driver.schedule()  # x needs a block and is the worst: it preempts itself; r waits
    assert so.total_num_scheduled_tokens == 0 and x.status == RequestStatus.PREEMPTED
    driver.process()
    so = driver.schedule()  # r again, its previous step still in flight (and x resumes)
    assert so.num_scheduled_tokens["r"] == 1 and r.num_output_placeholders == 2
    assert "r" not in so.scheduled_cached_reqs.all_token_ids
    generated = driver.run_to_completion()
    assert generated == {"x": expected_outputs(x, 4), "r": expected_outputs(r, 4)}


def test_blocks_are_cached_over_known_tokens_only(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    a = make_request("a", prompt=7, max_tokens=3)
    scheduler.add_request(a)
    num_cached_block = scheduler.kv_cache_manager.num_cached_block
    driver = AsyncDriver(scheduler)
    driver.schedule()  # positions 0-6: block 0 is full and known
    driver.schedule()  # position 7 fills block 1, but its token is still in flight
    assert num_cached_block["a"] == 1 and len(a.block_hashes) == 1
    driver.process()  # token 7 known; its KV is computed by the step in flight
    driver.schedule()
    assert num_cached_block["a"] == 2 and len(a.block_hashes) == 2
    driver.run_to_completion()
    # The cached blocks hold what a synchronous run would have cached: prompt + [1007].
    b = make_request("b", prompt=a.prompt_token_ids + [1007, 1], max_tokens=1)
    scheduler.add_request(b)
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    driver.queue.append((so, runner_output(scheduler, so)))
    driver.run_to_completion()


def test_abort_with_steps_in_flight(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler()
    a = make_request("a", prompt=4, max_tokens=10)
    scheduler.add_request(a)
    driver = AsyncDriver(scheduler)
    driver.schedule()
    driver.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    driver.process()
    driver.process()
    assert driver.generated == {} and a.output_token_ids == []
    so = scheduler.schedule()
    assert so.finished_req_ids == {"a"}


def random_requests(rng: random.Random, n: int) -> list[Request]:
    requests = []
    for i in range(n):
        prompt = rng.randrange(1, 30)
        stop = 1000 + prompt + rng.randrange(1, 12)  # some stop on a token before max_tokens
        requests.append(
            make_request(i, prompt=prompt, max_tokens=rng.randrange(1, 12), stop_token_ids=[stop])
        )
    return requests


@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_same_outputs_as_synchronous(
    make_scheduler: MakeScheduler, depth: int, use_v2: bool, policy: str
) -> None:
    """Chunked prefill, preemption (a small pool), stops and max_tokens together; the pool is
    full again at the end (the fixtures check it)."""
    results = []
    for async_depth in (None, depth):
        rng = random.Random(7)
        scheduler = make_scheduler(
            num_blocks=12, max_num_batched_tokens=16, policy=policy, use_v2_model_runner=use_v2
        )
        for request in random_requests(rng, 24):
            request.priority = rng.randrange(3)
            scheduler.add_request(request)
        if async_depth is None:
            results.append(run_to_completion(scheduler, position_token))
        else:
            results.append(AsyncDriver(scheduler, async_depth).run_to_completion())
            assert scheduler.make_stats().num_preemptions > 0
            assert not any(r.num_async_tokens_to_discard for r in scheduler.requests.values())
    assert results[0] == results[1]
