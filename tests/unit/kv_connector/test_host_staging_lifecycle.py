"""Host staging, scheduler role: which staging blocks each request holds, and that the staging
pool is full again on every terminal path (read, lease over, aborted, failed read), beside the
block pool (kv_buffer_device "cpu" with host_staging forced on, as the CPU suite runs it)."""

from __future__ import annotations

import logging

import msgspec
import pytest

from pdserve.kv_connector.nixl.metadata import SaveReqMeta
from pdserve.kv_connector.nixl.staging import StagingPool
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

NUM_TOKENS = int(2.5 * BLOCK_SIZE)  # three blocks
STAGING_BLOCKS = 64  # one request of the tiny model's max_model_len (1024 tokens)


def _staged(model: str, role: str, **kwargs: object) -> Scheduler:
    return create_scheduler(
        model,
        kv_role=role,
        kv_buffer_device="cpu",
        host_staging=True,
        host_buffer_blocks=STAGING_BLOCKS,
        **kwargs,
    )


def _pool(scheduler: Scheduler) -> StagingPool:
    staging = scheduler.connector.staging
    assert staging is not None
    return staging


def _assert_all_free(scheduler: Scheduler) -> None:
    assert_scheduler_empty(scheduler)
    assert _pool(scheduler).num_free == STAGING_BLOCKS


# ---- prefill side ---------------------------------------------------------------------------


def test_prefill_stages_its_prompt_and_frees_device_blocks_at_once(
    model: str, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = _staged(model, "kv_producer")
    staging = _pool(scheduler)
    request = create_request(1, NUM_TOKENS, do_remote_decode=True)
    req_id = request.request_id
    scheduler.add_request(request)

    out = scheduler.schedule()
    staging_ids = staging.get(req_id)
    assert staging_ids is not None and len(staging_ids) == 3
    blocks = scheduler.kv_cache_manager.get_block_ids(req_id)
    # The prompt is complete in this step: the worker copies it after the forward pass.
    assert connector_meta(out).reqs_to_save == {req_id: SaveReqMeta(blocks, staging_ids)}
    (output,) = scheduler.update_from_output(out, create_model_runner_output([request]))
    assert output.finish_reason == FinishReason.LENGTH
    assert output.kv_transfer_params.remote_block_ids == staging_ids
    # The reader reads the staged copy: the device blocks are free already.
    assert req_id not in scheduler.requests and not scheduler.kv_cache_manager.req_to_blocks

    out = scheduler.schedule()
    assert list(connector_meta(out).reqs_to_send) == [req_id]
    assert scheduler.connector.has_pending_transfers() and staging.num_free == STAGING_BLOCKS - 3
    step(scheduler, [], finished_sending={"id-unknown"})
    assert staging.num_free == STAGING_BLOCKS - 3
    with caplog.at_level(logging.WARNING):
        # The reader's done, or the lease's end: the same report from the workers.
        step(scheduler, [], finished_sending={req_id})
    assert "Unexpected finished KV send for request id-1" not in caplog.text
    _assert_all_free(scheduler)


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
def test_chunked_prompt_is_saved_whole_in_its_last_step(model: str, use_v2: bool) -> None:
    scheduler = _staged(model, "kv_producer", use_v2=use_v2)
    request = create_request(1, 100, do_remote_decode=True)  # 64 + 36 tokens, 7 blocks
    req_id = request.request_id
    scheduler.add_request(request)
    out = step(scheduler, [])
    assert not connector_meta(out).reqs_to_save
    out = scheduler.schedule()
    (save,) = connector_meta(out).reqs_to_save.values()
    assert save.block_ids == scheduler.kv_cache_manager.get_block_ids(req_id)
    assert len(save.block_ids) == 7 and save.staging_block_ids == _pool(scheduler).get(req_id)
    scheduler.update_from_output(out, create_model_runner_output([request]))
    step(scheduler, [])
    step(scheduler, [], finished_sending={req_id})
    _assert_all_free(scheduler)


def test_prefill_aborted_before_its_prompt_is_computed_frees_staging(model: str) -> None:
    scheduler = _staged(model, "kv_producer")
    request = create_request(1, 100, do_remote_decode=True)
    scheduler.add_request(request)
    step(scheduler, [])
    assert _pool(scheduler).num_free == STAGING_BLOCKS - 7
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    out = step(scheduler, [])
    assert not connector_meta(out).reqs_to_save and not connector_meta(out).reqs_to_send
    _assert_all_free(scheduler)


def test_prefill_waits_for_staging_room(model: str) -> None:
    """A full staging pool holds admissions back until a lease ends, without refusing them."""
    scheduler = _staged(model, "kv_producer")
    big = create_request(1, 1000, do_remote_decode=True)  # 63 of the 64 staging blocks
    small = create_request(2, NUM_TOKENS, do_remote_decode=True)
    scheduler.add_request(big)
    scheduler.add_request(small)
    while not big.is_finished():
        out = scheduler.schedule()
        assert small.request_id not in out.num_scheduled_tokens
        # A token only once the step completes the prompt.
        reqs = [big] if big.num_computed_tokens >= big.num_prompt_tokens else []
        scheduler.update_from_output(out, create_model_runner_output(reqs))
    assert small.status == RequestStatus.WAITING
    assert not scheduler.kv_cache_manager.get_blocks(small.request_id)
    step(scheduler, [], finished_sending={big.request_id})
    out = step(scheduler, [small])
    assert small.is_finished() and len(connector_meta(out).reqs_to_save) == 1
    step(scheduler, [], finished_sending={small.request_id})
    _assert_all_free(scheduler)


# ---- decode side ----------------------------------------------------------------------------


def test_decode_reads_into_staging_then_frees_it(model: str) -> None:
    scheduler = _staged(model, "kv_consumer")
    staging = _pool(scheduler)
    request = create_request(1, NUM_TOKENS, do_remote_prefill=True)
    req_id = request.request_id
    scheduler.add_request(request)
    out = step(scheduler, [])
    recv = connector_meta(out).reqs_to_recv[req_id]
    assert recv.staging_block_ids == staging.get(req_id) and len(recv.staging_block_ids) == 3
    assert recv.local_block_ids == scheduler.kv_cache_manager.get_block_ids(req_id)
    step(scheduler, [], finished_recving={req_id})
    assert staging.num_free == STAGING_BLOCKS
    step(scheduler, [request])
    step(scheduler, [request], use_eos=True)
    scheduler.schedule()
    _assert_all_free(scheduler)


def test_decode_failed_read_frees_staging(model: str) -> None:
    scheduler = _staged(model, "kv_consumer")
    request = create_request(1, NUM_TOKENS, do_remote_prefill=True)
    req_id = request.request_id
    scheduler.add_request(request)
    step(scheduler, [])
    blocks = set(scheduler.kv_cache_manager.get_block_ids(req_id))
    # A dead peer, a timeout, a failed handshake: the worker reports the blocks and the end.
    step(scheduler, [], finished_recving={req_id}, invalid_block_ids=blocks)
    assert request.status == RequestStatus.FINISHED_ERROR
    scheduler.schedule()
    _assert_all_free(scheduler)


def test_decode_aborted_while_reading_keeps_staging_until_the_read_ends(model: str) -> None:
    scheduler = _staged(model, "kv_consumer")
    request = create_request(1, NUM_TOKENS, do_remote_prefill=True)
    req_id = request.request_id
    scheduler.add_request(request)
    step(scheduler, [])
    scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
    step(scheduler, [])
    # The READ may still be writing into the staging blocks.
    assert _pool(scheduler).num_free == STAGING_BLOCKS - 3
    step(scheduler, [], finished_recving={req_id})
    _assert_all_free(scheduler)


def test_decode_heterogeneous_tp_reads_into_its_topology_staging(model: str) -> None:
    scheduler = _staged(model, "kv_consumer")
    request = create_request(1, NUM_TOKENS, do_remote_prefill=True)
    assert request.kv_transfer_params is not None
    request.kv_transfer_params = msgspec.structs.replace(request.kv_transfer_params, tp_size=2)
    scheduler.add_request(request)
    out = step(scheduler, [])
    assert connector_meta(out).reqs_to_recv[request.request_id].staging_block_ids == []
    assert _pool(scheduler).num_free == STAGING_BLOCKS
    step(scheduler, [], finished_recving={request.request_id})
    step(scheduler, [request], use_eos=True)
    scheduler.schedule()
    _assert_all_free(scheduler)


def test_decode_waits_for_staging_room(model: str) -> None:
    scheduler = _staged(model, "kv_consumer")
    big = create_request(1, 1000, do_remote_prefill=True, num_remote_blocks=63)
    small = create_request(2, NUM_TOKENS, do_remote_prefill=True)
    scheduler.add_request(big)
    scheduler.add_request(small)
    out = step(scheduler, [])
    assert list(connector_meta(out).reqs_to_recv) == [big.request_id]
    assert small.status == RequestStatus.WAITING
    assert not scheduler.kv_cache_manager.get_blocks(small.request_id)
    step(scheduler, [], finished_recving={big.request_id})
    out = scheduler.schedule()  # the big one runs, the small one starts its read
    assert list(connector_meta(out).reqs_to_recv) == [small.request_id]
    scheduler.update_from_output(out, create_model_runner_output([big], use_eos=True))
    step(scheduler, [], finished_recving={small.request_id})
    step(scheduler, [small], use_eos=True)
    scheduler.schedule()
    _assert_all_free(scheduler)


def test_staging_pool_must_hold_one_longest_request(model: str) -> None:
    with pytest.raises(ValueError, match="host_buffer_blocks must hold one request"):
        create_scheduler(model, kv_buffer_device="cpu", host_staging=True, host_buffer_blocks=10)
