"""Recompute preemption: victim choice, no admissions while preempting, and how a resumed
request reaches runner V1 (cached, block table replaced) and runner V2 (new, with its tokens)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve.request import RequestStatus
from pdserve.scheduler.scheduler import Scheduler

from .conftest import make_request, run_to_completion, runner_output, step

MakeScheduler = Callable[..., Scheduler]


def test_fcfs_preempts_the_most_recently_admitted(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(num_blocks=4)  # 3 usable blocks of 4 tokens
    requests = [make_request(name, prompt=4, max_tokens=3) for name in "abc"]
    for request in requests:
        scheduler.add_request(request)
    step(scheduler)  # one full block each; each now holds 5 tokens
    out, _ = step(scheduler)
    # a needs a block: c (the tail) goes. b needs one: only b itself is left to preempt.
    assert list(out.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    for name in "bc":
        request = scheduler.requests[name]
        assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
        assert not scheduler.kv_cache_manager.get_block_ids(name)
    stats = scheduler.make_stats()
    assert (stats.num_preemptions, stats.num_running_reqs, stats.num_waiting_reqs) == (2, 1, 2)
    run_to_completion(scheduler)
    assert [len(r.output_token_ids) for r in requests] == [3, 3, 3]


def test_no_admission_in_a_step_that_preempted(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(num_blocks=5)  # 4 usable blocks
    scheduler.add_request(make_request("a", prompt=4, max_tokens=2))
    scheduler.add_request(make_request("big", prompt=12, max_tokens=2))
    step(scheduler)  # a: 1 block, big: 3 blocks, pool full
    scheduler.add_request(make_request("small", prompt=3, max_tokens=1))
    out = scheduler.schedule()
    # a's new block came from preempting big, which freed 3: the 2 left free would hold
    # "small", but a step that preempted admits nobody.
    assert list(out.num_scheduled_tokens) == ["a"] and not out.scheduled_new_reqs
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 2
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]
    scheduler.update_from_output(out, runner_output(scheduler, out))  # a finishes
    out, _ = step(scheduler)  # a finished last step; big comes back first
    assert list(out.num_scheduled_tokens)[0] == "big"
    run_to_completion(scheduler)


def test_priority_preempts_the_worst_and_returns_its_budget(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(num_blocks=4, policy="priority")  # 3 usable blocks
    scheduler.add_request(make_request("low", prompt=4, priority=5, arrival_time=1.0, max_tokens=5))
    step(scheduler)  # low: 1 block
    scheduler.add_request(
        make_request("high", prompt=3, priority=0, arrival_time=2.0, max_tokens=3)
    )
    step(scheduler)  # low takes its 2nd block, high its 1st: the pool is full
    step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["low", "high"]
    out, _ = step(scheduler)
    # low (scheduled first) fits; high needs a block: the victim is low, the worst priority,
    # although it is not the tail and was already scheduled: its token goes back.
    assert out.num_scheduled_tokens == {"high": 1} and out.total_num_scheduled_tokens == 1
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED
    run_to_completion(scheduler)


def test_new_block_ids_stay_with_their_requests_when_a_victim_gives_back(
    make_scheduler: MakeScheduler,
) -> None:
    scheduler = make_scheduler(num_blocks=5, policy="priority")  # 4 usable blocks
    scheduler.add_request(make_request("low", prompt=2, priority=5, max_tokens=8))
    step(scheduler)
    scheduler.add_request(make_request("mid", prompt=4, priority=1, max_tokens=8))
    scheduler.add_request(make_request("high", prompt=4, priority=0, max_tokens=8))
    step(scheduler)  # high and mid take one block each: one is left
    assert [r.request_id for r in scheduler.running] == ["low", "high", "mid"]
    out, _ = step(scheduler)
    # low is scheduled, high takes the last block, mid finds none: low (the worst priority,
    # already scheduled) gives its tokens and blocks back, and high's row moves up.
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["high", "mid"]
    get_block_ids = scheduler.kv_cache_manager.get_block_ids
    assert cached.new_block_ids == [get_block_ids("high")[1:], get_block_ids("mid")[1:]]
    run_to_completion(scheduler)


def test_priority_victim_is_latest_arrival_among_equals(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(num_blocks=4, policy="priority")  # 3 usable blocks
    for name, arrival in (("x", 1.0), ("y", 3.0), ("z", 2.0)):
        scheduler.add_request(
            make_request(name, prompt=4, priority=1, arrival_time=arrival, max_tokens=2)
        )
    step(scheduler)
    out, _ = step(scheduler)  # x needs a block: y (same priority, latest arrival) goes
    assert list(out.num_scheduled_tokens)[0] == "x"
    assert scheduler.requests["y"].status == RequestStatus.PREEMPTED
    run_to_completion(scheduler)


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
def test_resumed_request_emission(make_scheduler: MakeScheduler, use_v2: bool) -> None:
    scheduler = make_scheduler(num_blocks=4, use_v2_model_runner=use_v2)  # 3 usable blocks
    a = make_request("a", prompt=4, max_tokens=2)
    b = make_request("b", prompt=8, max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out, _ = step(scheduler)  # a: 1 block, b: 2 blocks; the pool is full
    if use_v2:
        assert [r.prefill_token_ids for r in out.scheduled_new_reqs] == [
            a.prompt_token_ids,
            b.prompt_token_ids,
        ]
        assert out.preempted_req_ids == set()
    b_blocks = scheduler.kv_cache_manager.get_block_ids("b")

    out = scheduler.schedule()  # a needs a block: b is preempted (b's tail block goes to a)
    assert list(out.num_scheduled_tokens) == ["a"]
    assert out.preempted_req_ids == ({"b"} if use_v2 else None)
    assert out.scheduled_cached_reqs.new_block_ids == [[b_blocks[1]]]
    scheduler.update_from_output(out, runner_output(scheduler, out))  # a finishes

    out, _ = step(scheduler)  # a finished last step; b resumes: 9 tokens, its 1st block hits
    assert out.num_scheduled_tokens == {"b": 5}
    block_ids = scheduler.kv_cache_manager.get_block_ids("b")
    assert len(block_ids) == 3 and block_ids[0] == b_blocks[0]
    cached = out.scheduled_cached_reqs
    if use_v2:
        assert out.preempted_req_ids == set()
        assert not cached.req_ids and not cached.resumed_req_ids
        (new,) = out.scheduled_new_reqs
        assert new.req_id == "b" and new.block_ids == block_ids and new.num_computed_tokens == 4
        assert new.prefill_token_ids == b.prompt_token_ids + [7]
    else:
        assert out.preempted_req_ids is None and not out.scheduled_new_reqs
        assert cached.req_ids == ["b"] and cached.resumed_req_ids == {"b"}
        assert cached.new_block_ids == [block_ids]
        assert cached.all_token_ids == {"b": b.prompt_token_ids + [7]}
        assert cached.num_computed_tokens == [4] and cached.num_output_tokens == [1]

    out, _ = step(scheduler)  # b is an ordinary running request again
    assert (
        out.scheduled_cached_reqs.req_ids == ["b"] and not out.scheduled_cached_reqs.resumed_req_ids
    )
    assert not out.scheduled_cached_reqs.all_token_ids
    run_to_completion(scheduler)
    assert b.output_token_ids == [7, 7, 7]


def test_abort_preempted_request(make_scheduler: MakeScheduler) -> None:
    scheduler = make_scheduler(num_blocks=3)
    scheduler.add_request(make_request("a", prompt=4, max_tokens=4))
    scheduler.add_request(make_request("b", prompt=4, max_tokens=4))
    step(scheduler)
    step(scheduler)
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.waiting and "b" not in scheduler.requests
    run_to_completion(scheduler)
