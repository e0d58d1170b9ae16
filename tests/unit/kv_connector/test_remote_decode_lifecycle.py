"""Prefill side: a request whose decode runs elsewhere. It prefills, samples its one token, and
keeps its blocks for the decode instance to read until the workers report them sent (or the
lease runs out); an aborted one frees at once (reference §4.5)."""

from __future__ import annotations

import pytest

from pdserve import envs
from pdserve.kv_connector.nixl import scheduler as nixl_scheduler
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from pdserve.request import FinishReason, RequestStatus
from pdserve.scheduler.scheduler import Scheduler

from .utils import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    connector_meta,
    create_model_runner_output,
    create_request,
    create_scheduler,
    step,
)


def _producer(model: str) -> Scheduler:
    return create_scheduler(model, kv_role="kv_producer")


class _Clock:
    """The connector's clock, fixed: a lease's expiry is exactly now + kv_lease_duration."""

    NOW = 1_000_000.0

    @staticmethod
    def time() -> float:
        return _Clock.NOW

    @staticmethod
    def monotonic() -> float:
        return _Clock.NOW


def test_basic_lifecycle(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_scheduler, "time", _Clock)
    scheduler = _producer(model)
    request = create_request(1, int(2.5 * BLOCK_SIZE), do_remote_decode=True)
    req_id = request.request_id
    scheduler.add_request(request)

    out = scheduler.schedule()
    (output,) = scheduler.update_from_output(out, create_model_runner_output([request]))
    assert output.finish_reason == FinishReason.LENGTH
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    blocks = scheduler.kv_cache_manager.get_blocks(req_id)
    # The lease's board slot and tag, which the reader checks after its READ.
    stamp = scheduler.connector.board.held[req_id]
    lease = scheduler.connector.lease_duration
    assert output.kv_transfer_params == KVTransferParams.from_json(
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [b.block_id for b in blocks],
            "remote_engine_id": scheduler.connector.engine_id,
            "remote_request_id": req_id,
            "remote_host": envs.side_channel_host(),
            "remote_port": envs.side_channel_port(),
            "tp_size": 1,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_cached_tokens": 0,
            "remote_epoch": scheduler.connector.epoch,
            "remote_lease": {"slot": stamp.slot, "tag": stamp.tag, "seconds": lease},
            "first_token_id": request.output_token_ids[0],
        }
    )
    # Finished, but its blocks wait for the reader.
    assert req_id in scheduler.finished_req_ids and not scheduler.has_unfinished_requests()
    assert req_id in scheduler.requests and len(blocks) == 3
    assert all(b.ref_cnt == 1 for b in blocks)

    out = scheduler.schedule()
    assert out.finished_req_ids == {req_id} and out.total_num_scheduled_tokens == 0
    assert not scheduler.finished_req_ids
    # The workers learn the lease: free the blocks unread after kv_lease_duration.
    reqs_to_send = connector_meta(out).reqs_to_send
    assert list(reqs_to_send) == [req_id]
    lease = scheduler.connector.lease_duration
    assert reqs_to_send[req_id] == _Clock.NOW + lease
    scheduler.update_from_output(out, EMPTY_MODEL_RUNNER_OUTPUT)
    assert scheduler.connector.has_pending_transfers()

    step(scheduler, [], finished_sending={"id-unknown"})  # no news of it: still held
    assert all(b.ref_cnt == 1 for b in blocks) and scheduler.connector.has_pending_transfers()
    step(scheduler, [], finished_sending={req_id})
    assert_scheduler_empty(scheduler)


def test_short_prompt_lifecycle(model: str) -> None:
    """Shorter than a block: the partial block is sent too."""
    scheduler = _producer(model)
    request = create_request(1, 8, do_remote_decode=True)
    scheduler.add_request(request)
    out = scheduler.schedule()
    (output,) = scheduler.update_from_output(out, create_model_runner_output([request]))
    assert output.kv_transfer_params is not None
    assert len(output.kv_transfer_params.remote_block_ids) == 1
    step(scheduler, [], finished_sending={request.request_id})
    assert_scheduler_empty(scheduler)


def test_prefix_cache_lifecycle(model: str) -> None:
    """A prefix hit's blocks are sent like the others: the reader gets every block."""
    scheduler = _producer(model)
    warm_tokens = int(3.5 * BLOCK_SIZE)
    warm = create_request(1, warm_tokens, common_prefix_len=warm_tokens, max_tokens=1)
    scheduler.add_request(warm)
    step(scheduler, [warm])  # prefilled, cached, finished
    num_tokens = int(2.5 * BLOCK_SIZE)
    request = create_request(2, num_tokens, common_prefix_len=num_tokens, do_remote_decode=True)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 2 * BLOCK_SIZE  # two hits
    (output,) = scheduler.update_from_output(out, create_model_runner_output([request]))
    assert output.kv_transfer_params is not None
    block_ids = output.kv_transfer_params.remote_block_ids
    assert len(block_ids) == 3
    assert block_ids == scheduler.kv_cache_manager.get_block_ids(request.request_id)
    step(scheduler, [], finished_sending={request.request_id})
    assert_scheduler_empty(scheduler)


def test_abort_during_kv_transfer(model: str) -> None:
    """The client goes away after the prefill finished: the reader may be reading right now,
    so the blocks stay until the workers report them sent."""
    scheduler = _producer(model)
    request = create_request(1, int(2.5 * BLOCK_SIZE), do_remote_decode=True)
    scheduler.add_request(request)
    step(scheduler, [request])
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED  # already finished
    assert len(scheduler.requests) == 1
    step(scheduler, [])
    assert len(scheduler.requests) == 1
    step(scheduler, [], finished_sending={request.request_id})
    assert_scheduler_empty(scheduler)


def test_aborted_before_it_finished_frees_at_once(model: str) -> None:
    """Aborted while prefilling: nobody will read it, so nothing is held and no params go out."""
    scheduler = create_scheduler(model, kv_role="kv_producer", max_num_batched_tokens=32)
    request = create_request(1, 4 * BLOCK_SIZE, do_remote_decode=True)
    scheduler.add_request(request)
    out = scheduler.schedule()  # the first of two chunks
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    assert request.request_id not in scheduler.requests
    assert scheduler.update_from_output(out, create_model_runner_output([])) == []
    out = scheduler.schedule()
    assert out.finished_req_ids == {request.request_id}
    assert not connector_meta(out).reqs_to_send
    assert_scheduler_empty(scheduler)
