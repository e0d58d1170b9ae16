"""Cached tokens through the split (pd_lessons 17): the prefill side returns its prefix-cache
hits as `remote_cached_tokens`; the decode side reports the union of those and its own local
hits within what it loaded, each token once, and counts its prompt tokens by source."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.request import Request
from pdserve.scheduler.scheduler import Scheduler

from .utils import (
    BLOCK_SIZE,
    assert_scheduler_empty,
    create_model_runner_output,
    create_request,
    create_scheduler,
    step,
)

NUM_TOKENS = int(2.5 * BLOCK_SIZE)  # 40: two full blocks and half of a third


def sources(scheduler: Scheduler) -> tuple[int, int, int]:
    s = scheduler.make_stats().prompt_tokens_by_source
    return s.local_compute, s.local_cache_hit, s.external_kv_transfer


def run_local(scheduler: Scheduler, request: Request) -> None:
    scheduler.add_request(request)
    step(scheduler, [request], use_eos=True)
    scheduler.schedule()


def run_remote(scheduler: Scheduler, request: Request, bad_block: int | None = None) -> int:
    """Load, run and finish a remote-prefill request; returns its outputs' cached tokens."""
    scheduler.add_request(request)
    req_id = request.request_id
    step(scheduler, [])  # parked while it loads
    invalid = None
    if bad_block is not None:
        invalid = {scheduler.kv_cache_manager.get_block_ids(req_id)[bad_block]}
    step(scheduler, [], finished_recving={req_id}, invalid_block_ids=invalid)
    out = scheduler.schedule()
    (output,) = scheduler.update_from_output(
        out, create_model_runner_output([request], use_eos=True)
    )
    scheduler.schedule()
    return output.num_cached_tokens


def remote_request(request_id: int, remote_cached_tokens: object) -> Request:
    request = create_request(
        request_id, NUM_TOKENS, common_prefix_len=NUM_TOKENS, do_remote_prefill=True
    )
    assert request.kv_transfer_params is not None
    if remote_cached_tokens is not None:
        request.kv_transfer_params = msgspec.structs.replace(
            request.kv_transfer_params, remote_cached_tokens=remote_cached_tokens
        )
    return request


@pytest.mark.parametrize(
    "local_prefix,remote_cached,cached,by_source",
    [
        # Nothing here: the prefill side's hits are the client's; 39 loaded, the last recomputed.
        (0, 32, 32, (1, 0, 39)),
        (0, None, 0, (1, 0, 39)),
        # Both caches hold the same two blocks: counted once, not 64.
        (NUM_TOKENS, 32, 32, (1, 32, 7)),
        # The decode side holds more than the prefill side, or less: the union.
        (NUM_TOKENS, 16, 32, (1, 32, 7)),
        (20, 32, 32, (1, 16, 23)),
        # What no prefill instance sends (a wrong type is the HTTP layer's 400): bounded by
        # what was loaded.
        (0, 10**6, NUM_TOKENS - 1, (1, 0, 39)),
    ],
)
def test_decode_side_cached_tokens(
    model: str,
    local_prefix: int,
    remote_cached: object,
    cached: int,
    by_source: tuple[int, int, int],
) -> None:
    scheduler = create_scheduler(model)
    if local_prefix:  # the decode side's own prefix cache holds the prompt's first tokens
        run_local(scheduler, create_request(1, NUM_TOKENS, common_prefix_len=local_prefix))
    before = sources(scheduler)
    assert run_remote(scheduler, remote_request(2, remote_cached)) == cached
    assert tuple(a - b for a, b in zip(sources(scheduler), before)) == by_source
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("local_prefix,by_source", [(0, (0, 0, 40)), (NUM_TOKENS, (0, 32, 8))])
def test_a_shipped_first_token_leaves_no_prompt_token_to_compute(
    model: str, local_prefix: int, by_source: tuple[int, int, int]
) -> None:
    scheduler = create_scheduler(model)
    if local_prefix:
        run_local(scheduler, create_request(1, NUM_TOKENS, common_prefix_len=local_prefix))
    before = sources(scheduler)
    request = remote_request(2, 32)
    request.append_output_token_ids(7)  # the prefill instance's token: its KV is computed here
    assert run_remote(scheduler, request) == 32
    assert tuple(a - b for a, b in zip(sources(scheduler), before)) == by_source
    assert_scheduler_empty(scheduler)


def test_a_failed_load_recomputed_here_is_not_cached(model: str) -> None:
    scheduler = create_scheduler(model, policy="recompute")
    # The second block did not arrive: the prefill side's hit on it was computed again here.
    assert run_remote(scheduler, remote_request(1, 32), bad_block=1) == BLOCK_SIZE
    assert sources(scheduler) == (NUM_TOKENS - BLOCK_SIZE, 0, BLOCK_SIZE)
    assert_scheduler_empty(scheduler)


def test_prefill_side_returns_its_hits(model: str) -> None:
    scheduler = create_scheduler(model, kv_role="kv_producer")
    params, cached = [], []
    for request_id in (1, 2):
        request = create_request(
            request_id, NUM_TOKENS, common_prefix_len=NUM_TOKENS, do_remote_decode=True
        )
        scheduler.add_request(request)
        out = scheduler.schedule()
        (output,) = scheduler.update_from_output(out, create_model_runner_output([request]))
        params.append(output.kv_transfer_params.remote_cached_tokens)
        cached.append(output.num_cached_tokens)
    # The second finds the first's full blocks, still held for their reader.
    assert params == cached == [0, 32]
    assert sources(scheduler) == (NUM_TOKENS + NUM_TOKENS - 32, 32, 0)
    step(scheduler, [], finished_sending={"id-1", "id-2"})
    scheduler.schedule()
    assert_scheduler_empty(scheduler)
