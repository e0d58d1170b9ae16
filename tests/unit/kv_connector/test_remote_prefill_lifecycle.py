"""Decode side: a request whose prompt KV is read from a prefill instance, from admission to
its end, beside local requests and under a short block pool (reference §4.4)."""

from __future__ import annotations

import pytest

from pdserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from pdserve.request import FinishReason, Request, RequestStatus
from tests.unit.scheduler.conftest import runner_output

from .utils import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    connector_meta,
    create_model_runner_output,
    create_request,
    create_scheduler,
    num_running_waiting,
    num_waiting,
    step,
)

NUM_TOKENS = int(BLOCK_SIZE * 2.5)  # two full blocks and half of a third


def test_basic_lifecycle(model: str) -> None:
    scheduler = create_scheduler(model)
    pool = scheduler.kv_cache_manager.block_pool
    num_free = pool.get_num_free_blocks()
    request = create_request(1, NUM_TOKENS, do_remote_prefill=True)
    req_id = request.request_id
    scheduler.add_request(request)

    out = scheduler.schedule()  # blocks for the read; nothing for the model to run
    assert not scheduler.running and not out.scheduled_new_reqs
    assert not out.scheduled_cached_reqs.req_ids and out.total_num_scheduled_tokens == 0
    assert num_waiting(scheduler) == 1 and request in scheduler.remote_kv.skipped_waiting
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == NUM_TOKENS
    blocks = scheduler.kv_cache_manager.get_blocks(req_id)
    assert pool.get_num_free_blocks() == num_free - 3 and not pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in blocks)  # not filled yet
    recv = connector_meta(out).reqs_to_recv[req_id]
    assert recv.local_block_ids == [b.block_id for b in blocks]
    assert scheduler.update_from_output(out, EMPTY_MODEL_RUNNER_OUTPUT) == []

    out = scheduler.schedule()  # still reading
    assert num_waiting(scheduler) == 1 and not scheduler.running
    outputs = scheduler.update_from_output(
        out, create_model_runner_output([], finished_recving={req_id})
    )
    assert outputs == [] and num_waiting(scheduler) == 1
    assert req_id in scheduler.remote_kv.finished_recving_kv_req_ids

    out = scheduler.schedule()  # the read is done: it runs
    assert len(scheduler.running) == 1
    assert all(b.ref_cnt == 1 for b in blocks)
    assert sum(b.block_hash is not None for b in blocks) == 2  # the full blocks only
    (new_req,) = out.scheduled_new_reqs
    assert new_req.num_computed_tokens == NUM_TOKENS - 1  # the last token is recomputed
    num_prompt = len(new_req.prompt_token_ids)
    assert out.num_scheduled_tokens[req_id] == num_prompt - new_req.num_computed_tokens
    scheduler.update_from_output(out, create_model_runner_output([request]))

    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, create_model_runner_output([request], use_eos=True))
    scheduler.schedule()
    assert [o.finish_reason for o in outputs] == [FinishReason.STOP]
    assert_scheduler_empty(scheduler)


def test_interleaved_lifecycle(model: str) -> None:
    scheduler = create_scheduler(model)
    remote = create_request(1, NUM_TOKENS, do_remote_prefill=True)
    local_a, local_b = create_request(2, NUM_TOKENS), create_request(3, NUM_TOKENS)

    def news(*reqs: Request, **kv_news: set[str]) -> tuple[int, int]:
        out = step(scheduler, list(reqs), **kv_news)
        return len(out.scheduled_new_reqs), len(out.scheduled_cached_reqs.req_ids)

    scheduler.add_request(local_a)
    assert news(local_a) == (1, 0)
    scheduler.add_request(local_b)
    scheduler.add_request(remote)
    assert news(local_a, local_b) == (1, 1)
    assert num_running_waiting(scheduler) == (2, 1)
    assert news(local_a, local_b) == (0, 2)  # the KV has not arrived
    assert news(local_a, local_b, finished_recving={remote.request_id}) == (0, 2)
    assert num_running_waiting(scheduler) == (2, 1)
    assert news(local_a, local_b, remote) == (1, 2)  # it arrived: the remote one joins
    assert num_running_waiting(scheduler) == (3, 0)
    step(scheduler, [local_a, local_b, remote], use_eos=True)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_no_spurious_prefix_caching(model: str) -> None:
    """Blocks allocated for a read hold nothing until it ends: a local request with the same
    prompt must not hit them."""
    scheduler = create_scheduler(model)
    remote = create_request(1, NUM_TOKENS, common_prefix_len=NUM_TOKENS, do_remote_prefill=True)
    local = create_request(2, NUM_TOKENS, common_prefix_len=NUM_TOKENS)
    assert remote.prompt_token_ids == local.prompt_token_ids
    scheduler.add_request(remote)
    scheduler.update_from_output(scheduler.schedule(), EMPTY_MODEL_RUNNER_OUTPUT)
    scheduler.add_request(local)
    out = scheduler.schedule()
    assert len(scheduler.running) == 1 and num_waiting(scheduler) == 1
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit
    manager = scheduler.kv_cache_manager
    local_blocks = manager.get_blocks(local.request_id)
    remote_blocks = manager.get_blocks(remote.request_id)
    assert all(b.ref_cnt == 1 for b in local_blocks + remote_blocks)
    assert any(b.block_hash is not None for b in local_blocks)
    assert all(b.block_hash is None for b in remote_blocks)

    scheduler.finish_requests([local.request_id, remote.request_id], RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(
        out, create_model_runner_output([local], finished_recving={remote.request_id})
    )
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_full_block_prompt(model: str) -> None:
    """A prompt of whole blocks arrives whole: its last token is recomputed, in its last block."""
    scheduler = create_scheduler(model)
    num_tokens = 2 * BLOCK_SIZE
    request = create_request(1, num_tokens, do_remote_prefill=True)
    req_id = request.request_id
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), EMPTY_MODEL_RUNNER_OUTPUT)
    assert len(scheduler.kv_cache_manager.get_blocks(req_id)) == 2
    out = scheduler.schedule()
    scheduler.update_from_output(out, create_model_runner_output([], finished_recving={req_id}))
    assert num_waiting(scheduler) == 1 and req_id in scheduler.remote_kv.finished_recving_kv_req_ids

    out = scheduler.schedule()
    assert len(scheduler.kv_cache_manager.get_blocks(req_id)) == 2
    assert out.scheduled_new_reqs[0].num_computed_tokens == num_tokens - 1
    assert out.num_scheduled_tokens[req_id] == 1
    scheduler.update_from_output(out, create_model_runner_output([request]))
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, create_model_runner_output([request], use_eos=True))
    scheduler.schedule()
    assert [o.finish_reason for o in outputs] == [FinishReason.STOP]
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("use_v2", [False, True], ids=["v1", "v2"])
def test_cannot_schedule_after_recv(model: str, use_v2: bool) -> None:
    """The read ends but the request cannot grow: it is preempted like any other, and resumes
    from the blocks it cached at promotion."""
    scheduler = create_scheduler(model, num_blocks=6, use_v2=use_v2)  # 5 usable
    normal = create_request(1, 2 * BLOCK_SIZE)
    remote = create_request(2, 2 * BLOCK_SIZE, do_remote_prefill=True)

    scheduler.add_request(normal)
    step(scheduler, [normal])
    assert num_running_waiting(scheduler) == (1, 0)
    scheduler.add_request(remote)
    step(scheduler, [normal])  # normal holds 3 blocks, remote 2 for its read
    assert num_running_waiting(scheduler) == (1, 1)
    step(scheduler, [normal], finished_recving={remote.request_id})
    assert num_running_waiting(scheduler) == (1, 1)
    step(scheduler, [normal, remote])
    assert num_running_waiting(scheduler) == (2, 0)
    step(scheduler, [normal])  # remote needs a third block: preempted
    assert num_running_waiting(scheduler) == (1, 1) and remote.status == RequestStatus.PREEMPTED
    step(scheduler, [normal], use_eos=True)
    assert num_running_waiting(scheduler) == (0, 1)

    out = scheduler.schedule()  # it resumes from its two cached blocks
    if use_v2:
        num_computed = out.scheduled_new_reqs[0].num_computed_tokens
    else:
        num_computed = out.scheduled_cached_reqs.num_computed_tokens[0]
    assert num_computed == 2 * BLOCK_SIZE
    scheduler.update_from_output(out, create_model_runner_output([remote]))
    assert num_running_waiting(scheduler) == (1, 0)
    step(scheduler, [remote], use_eos=True)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_cannot_recv(model: str) -> None:
    """No blocks for the read: the request waits unread, and the read starts once they free."""
    scheduler = create_scheduler(model, num_blocks=6)  # 5 usable
    normal = create_request(1, 2 * BLOCK_SIZE)
    remote = create_request(2, NUM_TOKENS, do_remote_prefill=True)

    scheduler.add_request(normal)
    step(scheduler, [normal])
    scheduler.add_request(remote)
    out = step(scheduler, [normal])  # normal holds 3 blocks; the read needs 3 of the 2 left
    assert num_running_waiting(scheduler) == (1, 1)
    assert remote.status == RequestStatus.WAITING and not connector_meta(out).reqs_to_recv
    step(scheduler, [normal], use_eos=True)
    assert num_running_waiting(scheduler) == (0, 1)
    out = step(scheduler, [])  # now the read starts
    assert num_running_waiting(scheduler) == (0, 1)
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert list(connector_meta(out).reqs_to_recv) == [remote.request_id]
    step(scheduler, [], finished_recving={remote.request_id})
    assert num_running_waiting(scheduler) == (0, 1)
    step(scheduler, [remote])
    assert num_running_waiting(scheduler) == (1, 0)
    step(scheduler, [remote], use_eos=True)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_p_side_chunked_prefill(model: str) -> None:
    """Prefill side, in chunks: a 64-token remote-decode prompt in two 32-token chunks, then
    the one token the proxy asks for. vLLM's version of this test drops a Mamba model's last
    prompt token; pdserve has no Mamba models, so the whole prompt is prefilled here."""
    scheduler = create_scheduler(model, kv_role="kv_producer", max_num_batched_tokens=32)
    request = create_request(1, 64, do_remote_decode=True)
    req_id = request.request_id
    assert request.max_tokens == 1
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req_id: 32} and request.num_computed_tokens == 32
    assert scheduler.update_from_output(out, runner_output(scheduler, out)) == []  # mid-prefill
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req_id: 32} and request.num_computed_tokens == 64
    (output,) = scheduler.update_from_output(out, create_model_runner_output([request]))
    assert output.finish_reason == FinishReason.LENGTH
    params = output.kv_transfer_params
    assert params is not None and params.remote_num_tokens == 64
    assert params.remote_block_ids == scheduler.kv_cache_manager.get_block_ids(req_id)
    scheduler.update_from_output(
        scheduler.schedule(), create_model_runner_output([], finished_sending={req_id})
    )
    assert_scheduler_empty(scheduler)


def test_unexpected_transfer_ids_are_ignored(model: str) -> None:
    """A running request is neither receiving nor sending, and an unknown id names nothing:
    a confused report changes nothing and ends nothing."""
    scheduler = create_scheduler(model)
    request = create_request(1, NUM_TOKENS, max_tokens=2)
    scheduler.add_request(request)
    step(
        scheduler,
        [request],
        finished_sending={request.request_id, "id-gone"},
        finished_recving={request.request_id, "id-gone"},
    )
    assert (
        request.status == RequestStatus.RUNNING
        and not scheduler.remote_kv.finished_recving_kv_req_ids
    )
    assert len(scheduler.kv_cache_manager.get_blocks(request.request_id)) == 3
    step(scheduler, [request])
    scheduler.schedule()
    assert_scheduler_empty(scheduler)
