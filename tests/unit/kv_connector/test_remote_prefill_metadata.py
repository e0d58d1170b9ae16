"""Decode side: what the NixlConnector's scheduler role tells the workers to read, into which
blocks and from where (reference §4.6)."""

from __future__ import annotations

import msgspec

from pdserve.request import RequestStatus

from .utils import (
    BLOCK_SIZE,
    REMOTE_ENGINE_ID,
    assert_scheduler_empty,
    connector_meta,
    create_request,
    create_scheduler,
    step,
)


def test_recv_metadata_names_the_remote_blocks(model: str) -> None:
    scheduler = create_scheduler(model)
    assert scheduler.connector.server is None  # no side channel until handshakes
    request = create_request(1, int(2.5 * BLOCK_SIZE), do_remote_prefill=True)
    scheduler.add_request(request)
    meta = connector_meta(step(scheduler, []))
    recv = meta.reqs_to_recv[request.request_id]
    assert recv.local_block_ids == scheduler.kv_cache_manager.get_block_ids(request.request_id)
    assert recv.remote_block_ids == [0, 1, 2]
    assert (recv.remote_engine_id, recv.remote_request_id) == (REMOTE_ENGINE_ID, "prefill-1")
    assert (recv.remote_host, recv.remote_port, recv.remote_tp_size) == ("my-host", 1234, 1)
    # The prefill side's lease on its blocks is extended while the read waits.
    assert meta.heartbeats == {REMOTE_ENGINE_ID: ["prefill-1"]}
    # Only one read per request: the next step orders none.
    assert not connector_meta(step(scheduler, [])).reqs_to_recv

    step(scheduler, [], finished_recving={request.request_id})
    step(scheduler, [request], use_eos=True)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_partial_local_prefix_hit_reads_only_the_rest(model: str) -> None:
    """Two of three blocks are in the local prefix cache: only the third is read, from the
    last of the prefill side's blocks (the worker reads the tail of `remote_block_ids`)."""
    scheduler = create_scheduler(model)
    num_tokens = int(2.5 * BLOCK_SIZE)
    local = create_request(1, num_tokens, common_prefix_len=num_tokens, max_tokens=1)
    scheduler.add_request(local)
    step(scheduler, [local])  # prefilled, cached, finished
    remote = create_request(2, num_tokens, common_prefix_len=num_tokens, do_remote_prefill=True)
    scheduler.add_request(remote)
    out = step(scheduler, [])
    blocks = scheduler.kv_cache_manager.get_blocks(remote.request_id)
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert remote.num_computed_tokens == num_tokens
    recv = connector_meta(out).reqs_to_recv[remote.request_id]
    assert recv.local_block_ids == [blocks[2].block_id]
    assert recv.remote_block_ids[-len(recv.local_block_ids) :] == [2]

    step(scheduler, [], finished_recving={remote.request_id})
    out = step(scheduler, [remote], use_eos=True)
    assert out.scheduled_new_reqs[0].num_computed_tokens == num_tokens - 1
    scheduler.schedule()
    assert_scheduler_empty(scheduler)


def test_incomplete_params_prefill_locally(model: str) -> None:
    """Without a host to read from, nothing can arrive: the request must not wait for a read
    that never starts, but prefill here."""
    scheduler = create_scheduler(model)
    request = create_request(1, int(2.5 * BLOCK_SIZE), do_remote_prefill=True)
    assert request.kv_transfer_params is not None
    request.kv_transfer_params = msgspec.structs.replace(
        request.kv_transfer_params, remote_host=None
    )
    scheduler.add_request(request)
    out = step(scheduler, [request])
    assert request.status == RequestStatus.RUNNING and not connector_meta(out).reqs_to_recv
    assert out.num_scheduled_tokens == {request.request_id: request.num_prompt_tokens}
    step(scheduler, [request], use_eos=True)
    scheduler.schedule()
    assert_scheduler_empty(scheduler)
