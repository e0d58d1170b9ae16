"""Decode side: a remote-prefill request aborted at each stage frees its blocks exactly once,
never while a read may still write into them, and the prefill side always hears that it may
free its own (pd_lessons 1, 4)."""

from __future__ import annotations

from pdserve.request import Request, RequestStatus
from pdserve.scheduler.scheduler import Scheduler

from .utils import (
    BLOCK_SIZE,
    REMOTE_ENGINE_ID,
    assert_scheduler_empty,
    connector_meta,
    create_model_runner_output,
    create_request,
    create_scheduler,
    step,
)

ABORTED = RequestStatus.FINISHED_ABORTED


def _park(scheduler: Scheduler) -> Request:
    """Add a 40-token remote-prefill request and start its read."""
    request = create_request(1, int(2.5 * BLOCK_SIZE), do_remote_prefill=True)
    scheduler.add_request(request)
    step(scheduler, [])
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return request


def test_abort_while_reading_holds_blocks_until_the_read_ends(model: str) -> None:
    scheduler = create_scheduler(model)
    req_id = _park(scheduler).request_id
    blocks = scheduler.kv_cache_manager.get_blocks(req_id)
    scheduler.finish_requests(req_id, ABORTED)
    # The worker may still be writing into them: they stay, though the request is over.
    assert not scheduler.has_unfinished_requests() and req_id in scheduler.requests
    assert all(b.ref_cnt == 1 for b in blocks)
    # The engine must keep polling the workers until the read ends.
    assert scheduler.connector.has_pending_transfers()
    out = step(scheduler, [])
    assert out.finished_req_ids == {req_id} and all(b.ref_cnt == 1 for b in blocks)
    step(scheduler, [], finished_recving={req_id})
    assert req_id not in scheduler.requests
    step(scheduler, [], finished_recving={req_id})  # a repeated report frees nothing twice
    assert_scheduler_empty(scheduler)


def test_abort_after_the_read_before_scheduling(model: str) -> None:
    scheduler = create_scheduler(model)
    req_id = _park(scheduler).request_id
    step(scheduler, [], finished_recving={req_id})
    assert req_id in scheduler.remote_kv.finished_recving_kv_req_ids
    scheduler.finish_requests(req_id, ABORTED)  # the read is over: free at once
    assert req_id not in scheduler.requests and not scheduler.remote_kv.finished_recving_kv_req_ids
    out = scheduler.schedule()
    assert out.finished_req_ids == {req_id} and not connector_meta(out).reqs_to_recv
    assert_scheduler_empty(scheduler)


def test_abort_while_running(model: str) -> None:
    scheduler = create_scheduler(model)
    request = _park(scheduler)
    req_id = request.request_id
    step(scheduler, [], finished_recving={req_id})
    out = scheduler.schedule()
    assert scheduler.requests[req_id].status == RequestStatus.RUNNING
    scheduler.finish_requests(req_id, ABORTED)
    assert req_id not in scheduler.requests
    scheduler.finish_requests(req_id, ABORTED)  # unknown by now: ignored
    # The step that was in flight reports its token: dropped.
    assert scheduler.update_from_output(out, create_model_runner_output([request])) == []
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_abort_before_admission_sends_an_empty_read(model: str) -> None:
    """Never admitted, so never read: the prefill side still holds the request's blocks and
    learns from an empty read (a notification only) that it may free them."""
    scheduler = create_scheduler(model)
    request = create_request(1, int(2.5 * BLOCK_SIZE), do_remote_prefill=True)
    scheduler.add_request(request)
    scheduler.finish_requests(request.request_id, ABORTED)
    assert request.request_id not in scheduler.requests
    out = scheduler.schedule()
    recv = connector_meta(out).reqs_to_recv[request.request_id]
    assert recv.local_block_ids == [] and recv.remote_block_ids == [0, 1, 2]
    assert (recv.remote_engine_id, recv.remote_request_id) == (REMOTE_ENGINE_ID, "prefill-1")
    assert out.finished_req_ids == {request.request_id}
    # Until the worker reports the notification sent, the engine keeps polling.
    assert scheduler.connector.has_pending_transfers()
    step(scheduler, [], finished_recving={request.request_id})
    assert_scheduler_empty(scheduler)
