"""Decode side: a read that leaves blocks unwritten (`invalid_block_ids`). Policy "fail" ends
the request with an error the client sees; "recompute" prefills locally from the first bad
block. Either way the bad blocks never enter the prefix cache, and are freed exactly once."""

from __future__ import annotations

import pytest

from pdserve.request import FinishReason, RequestStatus

from .utils import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    connector_meta,
    create_model_runner_output,
    create_request,
    create_scheduler,
    step,
)

NUM_TOKENS = int(2.5 * BLOCK_SIZE)


@pytest.mark.parametrize("with_recv_done", [True, False], ids=["with_recv", "before_recv"])
def test_fail_policy_ends_the_request_with_an_error(model: str, with_recv_done: bool) -> None:
    scheduler = create_scheduler(model, policy="fail")
    request = create_request(1, NUM_TOKENS, common_prefix_len=NUM_TOKENS, do_remote_prefill=True)
    req_id = request.request_id
    scheduler.add_request(request)
    out = step(scheduler, [])
    blocks = scheduler.kv_cache_manager.get_blocks(req_id)
    recv_done = {req_id} if with_recv_done else None
    (output,) = scheduler.update_from_output(
        out,
        create_model_runner_output(
            [],
            finished_recving=recv_done,
            invalid_block_ids={blocks[1].block_id},
            load_errors={req_id: "the KV read from prefill engine e failed in the transport"},
        ),
    )
    assert output.request_id == req_id and output.finish_reason == FinishReason.ERROR
    # The connector's reason is the client's.
    assert output.error == "the KV read from prefill engine e failed in the transport"
    assert request.status == RequestStatus.FINISHED_ERROR
    assert not scheduler.has_unfinished_requests()
    if not with_recv_done:
        # The read has not ended: the worker may still write, so the blocks stay.
        assert all(b.ref_cnt == 1 for b in blocks) and req_id in scheduler.requests
        out = step(scheduler, [], finished_recving={req_id})
        assert out.finished_req_ids == {req_id}
    assert req_id not in scheduler.requests
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in blocks)
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block

    # The same prompt, computed here: no hit on what the failed read left behind.
    local = create_request(2, NUM_TOKENS, common_prefix_len=NUM_TOKENS)
    scheduler.add_request(local)
    out = step(scheduler, [local], use_eos=True)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_recompute_policy_prefills_the_whole_prompt_after_a_failed_read(model: str) -> None:
    scheduler = create_scheduler(model, policy="recompute")
    request = create_request(1, NUM_TOKENS, do_remote_prefill=True)
    req_id = request.request_id
    scheduler.add_request(request)
    out = step(scheduler, [])
    blocks = scheduler.kv_cache_manager.get_blocks(req_id)
    block_ids = [b.block_id for b in blocks]
    outputs = scheduler.update_from_output(
        out,
        create_model_runner_output([], finished_recving={req_id}, invalid_block_ids=set(block_ids)),
    )
    assert outputs == [] and request.num_computed_tokens == 0
    out = scheduler.schedule()
    # Prefilled here, in the blocks it already holds; none was cached before it was computed.
    (new_req,) = out.scheduled_new_reqs
    assert new_req.num_computed_tokens == 0 and new_req.block_ids == block_ids
    assert out.num_scheduled_tokens == {req_id: NUM_TOKENS}
    assert not connector_meta(out).reqs_to_recv
    outputs = scheduler.update_from_output(out, create_model_runner_output([request], use_eos=True))
    assert [o.finish_reason for o in outputs] == [FinishReason.STOP]
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_recompute_policy_keeps_the_tokens_before_the_first_bad_block(model: str) -> None:
    """Blocks 0-1 are local prefix hits, 2-4 are read and block 3 fails: tokens of blocks 0-2
    stay computed, blocks 3-4 are prefilled here, and only blocks 0-2 are cached before."""
    scheduler = create_scheduler(model, policy="recompute")
    prefix = 2 * BLOCK_SIZE
    warm = create_request(1, prefix + 8, common_prefix_len=prefix, max_tokens=1)
    scheduler.add_request(warm)
    step(scheduler, [warm])
    num_tokens = 4 * BLOCK_SIZE + 8
    request = create_request(2, num_tokens, common_prefix_len=prefix, do_remote_prefill=True)
    req_id = request.request_id
    scheduler.add_request(request)
    step(scheduler, [])
    blocks = scheduler.kv_cache_manager.get_blocks(req_id)
    assert [b.block_hash is not None for b in blocks] == [True, True, False, False, False]
    step(scheduler, [], finished_recving={req_id}, invalid_block_ids={blocks[3].block_id})
    assert request.num_computed_tokens == 3 * BLOCK_SIZE
    assert all(b.block_hash is None for b in blocks[2:])

    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK_SIZE
    assert out.num_scheduled_tokens == {req_id: BLOCK_SIZE + 8}
    assert scheduler.kv_cache_manager.get_blocks(req_id) == blocks
    scheduler.update_from_output(out, create_model_runner_output([request], use_eos=True))
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_bad_blocks_of_an_aborted_request_are_freed_once(model: str) -> None:
    scheduler = create_scheduler(model, policy="fail")
    request = create_request(1, NUM_TOKENS, do_remote_prefill=True)
    scheduler.add_request(request)
    step(scheduler, [])
    block_ids = set(scheduler.kv_cache_manager.get_block_ids(request.request_id))
    scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(
        out,
        create_model_runner_output(
            [], finished_recving={request.request_id}, invalid_block_ids=block_ids
        ),
    )
    assert outputs == []  # aborted by the client: it expects no error
    scheduler.schedule()
    assert_scheduler_empty(scheduler)
