"""Decode side: the blocks parked loads hold, beside admissions and running requests, with the
NixlConnector's own scheduler role. A Nixl load reads the whole prompt beyond the local prefix
hit, so a parked load already holds every block its prompt needs: nothing more is kept free
for it, and every path ends (pd_lessons: every path must end)."""

from __future__ import annotations

from pdserve.request import RequestStatus

from .utils import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    connector_meta,
    create_request,
    create_scheduler,
    num_running_waiting,
    step,
)


def test_parked_loads_that_fill_the_pool_are_both_admitted(model: str) -> None:
    """A reads 4 blocks, B 3: together the 7 usable blocks. Neither keeps a block free for
    the other, so both reads start in the same step, and both requests run once they land."""
    scheduler = create_scheduler(model, num_blocks=8)  # 7 usable
    req_a = create_request(1, 4 * BLOCK_SIZE, do_remote_prefill=True, num_remote_blocks=4)
    req_b = create_request(2, 3 * BLOCK_SIZE, do_remote_prefill=True)
    scheduler.add_request(req_a)
    scheduler.add_request(req_b)
    out = step(scheduler, [])
    assert req_a.status == req_b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert set(connector_meta(out).reqs_to_recv) == {req_a.request_id, req_b.request_id}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0

    step(scheduler, [], finished_recving={req_a.request_id, req_b.request_id})
    out = step(scheduler, [req_a, req_b], use_eos=True)
    # Each recomputes its last prompt token in a block it holds.
    assert out.num_scheduled_tokens == {req_a.request_id: 1, req_b.request_id: 1}
    assert num_running_waiting(scheduler) == (0, 0)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_a_load_that_does_not_fit_waits_without_taking_blocks(model: str) -> None:
    """B's prompt needs 5 blocks and 3 are free while A's read holds 4: B waits holding
    none (a partial allocation could starve A), and reads once A ends."""
    scheduler = create_scheduler(model, num_blocks=8)  # 7 usable
    req_a = create_request(1, 4 * BLOCK_SIZE, do_remote_prefill=True, num_remote_blocks=4)
    req_b = create_request(2, 5 * BLOCK_SIZE, do_remote_prefill=True, num_remote_blocks=5)
    scheduler.add_request(req_a)
    scheduler.add_request(req_b)
    out = step(scheduler, [])
    assert list(connector_meta(out).reqs_to_recv) == [req_a.request_id]
    assert req_b.status == RequestStatus.WAITING
    assert not scheduler.kv_cache_manager.get_blocks(req_b.request_id)

    step(scheduler, [], finished_recving={req_a.request_id})
    step(scheduler, [req_a], use_eos=True)
    out = step(scheduler, [])
    assert list(connector_meta(out).reqs_to_recv) == [req_b.request_id]
    assert len(scheduler.kv_cache_manager.get_blocks(req_b.request_id)) == 5
    step(scheduler, [], finished_recving={req_b.request_id})
    step(scheduler, [req_b], use_eos=True)
    assert num_running_waiting(scheduler) == (0, 0)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_parked_load_leaves_running_requests_alone(model: str) -> None:
    """A running request grows into the block left free beside a parked load and is not
    preempted for it; the load, promoted, runs in the blocks it holds."""
    scheduler = create_scheduler(model, num_blocks=7)  # 6 usable
    manager = scheduler.kv_cache_manager
    normal = create_request(1, 2 * BLOCK_SIZE, max_tokens=BLOCK_SIZE)
    parked = create_request(2, int(2.5 * BLOCK_SIZE), max_tokens=4, do_remote_prefill=True)
    scheduler.add_request(normal)
    step(scheduler, [normal])
    scheduler.add_request(parked)
    step(scheduler, [normal])  # normal's third block; parked holds its 3
    assert parked.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(manager.get_blocks(normal.request_id)) == 3
    assert manager.block_pool.get_num_free_blocks() == 0
    step(scheduler, [normal], finished_recving={parked.request_id})
    out = step(scheduler, [normal, parked])
    assert out.num_scheduled_tokens[parked.request_id] == 1
    while scheduler.has_unfinished_requests():
        step(scheduler, [r for r in (normal, parked) if not r.is_finished()])
    assert not scheduler.num_preemptions
    assert normal.num_output_tokens == BLOCK_SIZE and parked.num_output_tokens == 4
    scheduler.schedule()
    assert_scheduler_empty(scheduler)
