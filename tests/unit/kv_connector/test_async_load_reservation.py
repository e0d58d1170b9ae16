"""Decode side: blocks kept free for parked loads. A load is admitted only if, beside what the
loads already parked still need, the rest of its own prompt fits too; else two loads that each
hold part of a full pool wait for each other's blocks forever, with nothing running to free
any (pd_lessons: every path must end)."""

from __future__ import annotations

from unittest.mock import patch

from pdserve.request import RequestStatus

from .utils import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    create_request,
    create_scheduler,
    num_running_waiting,
    step,
)


def test_async_load_reserves_blocks_for_its_own_prompt(model: str) -> None:
    """A reads 1 of its 4 blocks (3 kept for it). B would read 1 of its 5: 1 + 4 for itself +
    3 for A is more than the 6 free blocks, so B waits; admitted, A and B would hold 2 blocks,
    need 7 more and find 5."""
    scheduler = create_scheduler(model, num_blocks=8)  # 7 usable
    req_a = create_request(1, 4 * BLOCK_SIZE, do_remote_prefill=True)
    req_b = create_request(2, 5 * BLOCK_SIZE, do_remote_prefill=True, num_remote_blocks=5)
    scheduler.add_request(req_a)
    scheduler.add_request(req_b)
    with patch.object(
        scheduler.connector,
        "get_num_new_matched_tokens",
        side_effect=[(BLOCK_SIZE, True), (BLOCK_SIZE, True)],
    ):
        scheduler.schedule()
    assert req_a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req_b.status == RequestStatus.WAITING
    assert not scheduler.kv_cache_manager.get_blocks(req_b.request_id)

    # Everything ends: A runs in the blocks kept for it, then B reads its whole prompt.
    out = step(scheduler, [], finished_recving={req_a.request_id})
    out = step(scheduler, [req_a], use_eos=True)
    assert out.num_scheduled_tokens == {req_a.request_id: 3 * BLOCK_SIZE}
    step(scheduler, [])
    assert req_b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(scheduler.kv_cache_manager.get_blocks(req_b.request_id)) == 5
    step(scheduler, [], finished_recving={req_b.request_id})
    step(scheduler, [req_b], use_eos=True)
    assert num_running_waiting(scheduler) == (0, 0)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_parked_loads_leave_running_requests_alone(model: str) -> None:
    """Blocks kept for a parked load bind admissions only: a running request still grows into
    them (it finishes and gives them back), and is not preempted for the parked one."""
    scheduler = create_scheduler(model, num_blocks=6)  # 5 usable
    manager = scheduler.kv_cache_manager
    normal = create_request(1, 2 * BLOCK_SIZE, max_tokens=2 * BLOCK_SIZE)
    parked = create_request(2, 2 * BLOCK_SIZE, do_remote_prefill=True)
    scheduler.add_request(normal)
    step(scheduler, [normal])
    scheduler.add_request(parked)
    with patch.object(
        scheduler.connector, "get_num_new_matched_tokens", side_effect=[(BLOCK_SIZE, True)]
    ):
        step(scheduler, [normal])  # normal takes a third block; parked holds 1, keeps 1
    assert parked.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert manager.block_pool.get_num_free_blocks() == 1
    while len(manager.get_blocks(normal.request_id)) < 4:  # the fourth is the one kept
        step(scheduler, [normal])
    assert normal.status == RequestStatus.RUNNING and not scheduler.num_preemptions
    assert manager.block_pool.get_num_free_blocks() == 0
    step(scheduler, [normal], use_eos=True, finished_recving={parked.request_id})
    out = step(scheduler, [parked], use_eos=True)
    assert out.num_scheduled_tokens == {parked.request_id: BLOCK_SIZE}
    scheduler.schedule()
    assert_scheduler_empty(scheduler)
