"""Failures PD users of vLLM and SGLang reported (shared/reference/pd_lessons.md), replayed at
the scheduler with the NixlConnector's real halves: its scheduler role beside the Scheduler,
and where bytes move, its worker roles over a real transport in this process. Each test names
its lesson."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch

from pdserve.kv_transfer_params import KVTransferParams
from pdserve.request import FinishReason, Request, RequestStatus
from pdserve.scheduler.output import SchedulerOutput
from tests.unit.kv_connector.halves import BLOCK_SIZE, Instance, poll
from tests.unit.kv_connector.utils import (
    assert_scheduler_empty,
    connector_meta,
    create_model_runner_output,
    create_request,
    create_scheduler,
    step,
)

from .conftest import make_request, runner_output

pytestmark = pytest.mark.timeout(120)

ABORTED = RequestStatus.FINISHED_ABORTED


@pytest.fixture
def model(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")


@pytest.fixture
def pair(model: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Instance]]:
    """make(role, num_blocks=...): instances, shut down after the test."""
    made: list[Instance] = []

    def make(role: str, **kwargs: object) -> Instance:
        made.append(Instance(model, role, monkeypatch, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for instance in made:
        instance.shutdown()


def prefill_for_decode(p: Instance, prompt: list[int], req_id: str = "r") -> dict:
    """The proxy's first hop: the prefill instance computes the prompt, samples one token and
    holds the blocks for a reader; returns the kv_transfer_params it answers with."""
    request = make_request(req_id, prompt=prompt, max_tokens=1)
    request.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    p.scheduler.add_request(request)
    _, outputs = p.step()
    (output,) = outputs
    assert output.finish_reason == FinishReason.LENGTH and output.kv_transfer_params
    return output.kv_transfer_params


def decode_request(params: KVTransferParams, prompt: list[int], req_id: str = "r") -> Request:
    request = make_request(req_id, prompt=prompt, max_tokens=3)
    request.kv_transfer_params = msgspec.structs.replace(params)
    return request


def run_until_both_empty(p: Instance, d: Instance) -> None:
    """Step both instances until neither holds a request, a block or a transfer."""

    def idle(instance: Instance) -> bool:
        scheduler = instance.scheduler
        return not scheduler.requests and not scheduler.connector.has_pending_transfers()

    def step_both() -> bool:
        d.step()
        p.step()
        return idle(p) and idle(d)

    poll(step_both)
    for instance in (p, d):
        instance.scheduler.schedule()  # carries the last finished ids to the worker
        assert_scheduler_empty(instance.scheduler)
        # Freed by the release under test, not rescued by a lease that expired later.
        assert instance.scheduler.connector.get_stats().get("expired_leases", 0) == 0


# ---- pd_lessons 1 ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [2 * BLOCK_SIZE, int(2.5 * BLOCK_SIZE)])
def test_full_local_prefix_hit_still_releases_the_prefill_side(
    pair: Callable[..., Instance], num_tokens: int
) -> None:
    """pd_lessons 1: the decode instance already holds the whole prompt in its prefix cache.
    It still reads the last block (the one it recomputes the last token in: a hit never
    covers it), and that read's `done` frees the prefill side's blocks, well before the lease
    would; the decode request runs and ends."""
    p, d = pair("kv_producer"), pair("kv_consumer")
    prompt = [1000 + i for i in range(num_tokens)]
    warm = make_request("warm", prompt=prompt, max_tokens=1)
    d.scheduler.add_request(warm)
    d.step()  # prefilled and cached, then finished
    assert warm.is_finished()

    params = prefill_for_decode(p, prompt)
    remote_blocks = params.remote_block_ids
    request = decode_request(params, prompt)
    d.scheduler.add_request(request)
    out, _ = d.step()
    recv = connector_meta(out).reqs_to_recv[request.request_id]
    blocks = d.scheduler.kv_cache_manager.get_blocks(request.request_id)
    num_hits = (num_tokens - 1) // BLOCK_SIZE
    assert [b.block_hash is not None for b in blocks] == [True] * num_hits + [False]
    assert recv.local_block_ids == [blocks[-1].block_id]

    run_until_both_empty(p, d)
    assert torch.equal(d.cache[recv.local_block_ids[0]], p.cache[remote_blocks[-1]])
    assert request.get_finished_reason() == FinishReason.LENGTH


# ---- pd_lessons 5 ---------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["same step", "receive first", "send first"])
def test_aborted_request_with_send_and_receive_completions(model: str, order: str) -> None:
    """pd_lessons 5 (vLLM #46240, #43226): a decode request aborted while its read is in
    flight, whose workers then report a finished receive and a finished send in one step, or
    in either order. The engine does not fail, and the blocks are freed exactly once, never
    before the receive ended (the transport may write into them until then)."""
    scheduler = create_scheduler(model)
    request = create_request(1, int(2.5 * BLOCK_SIZE), do_remote_prefill=True)
    req_id = request.request_id
    scheduler.add_request(request)
    step(scheduler, [])
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = scheduler.kv_cache_manager.get_blocks(req_id)
    scheduler.finish_requests(req_id, ABORTED)

    if order == "same step":
        step(scheduler, [], finished_sending={req_id}, finished_recving={req_id})
    elif order == "receive first":
        step(scheduler, [], finished_recving={req_id})
        assert req_id not in scheduler.requests
        step(scheduler, [], finished_sending={req_id})
    else:
        step(scheduler, [], finished_sending={req_id})
        # The read may still be writing: the blocks stay.
        assert req_id in scheduler.requests and all(b.ref_cnt == 1 for b in blocks)
        step(scheduler, [], finished_recving={req_id})
    assert req_id not in scheduler.requests
    step(scheduler, [], finished_sending={req_id}, finished_recving={req_id})  # stale: ignored
    assert_scheduler_empty(scheduler)


def test_prefill_side_blocks_wait_for_the_send_whatever_else_is_reported(model: str) -> None:
    """pd_lessons 5, the prefill side: a finished request holds its blocks for the reader; a
    receive completion for it (nobody reads into them) does not free them, the send does."""
    scheduler = create_scheduler(model, kv_role="kv_producer")
    request = create_request(1, int(2.5 * BLOCK_SIZE), do_remote_decode=True)
    req_id = request.request_id
    scheduler.add_request(request)
    step(scheduler, [request])
    blocks = scheduler.kv_cache_manager.get_blocks(req_id)
    scheduler.finish_requests(req_id, ABORTED)  # finished already: ignored
    step(scheduler, [], finished_recving={req_id})
    assert req_id in scheduler.requests and all(b.ref_cnt == 1 for b in blocks)
    step(scheduler, [], finished_sending={req_id}, finished_recving={req_id})
    assert_scheduler_empty(scheduler)


# ---- pd_lessons 6 ---------------------------------------------------------------------------


def _last_slots(instance: Instance, out: SchedulerOutput) -> list[tuple[int, int]]:
    """(block, slot) each request of a just-scheduled step writes its last token's KV into."""
    manager = instance.scheduler.kv_cache_manager
    slots = []
    for req_id, num_tokens in out.num_scheduled_tokens.items():
        # The scheduler has advanced the request past this step's tokens already.
        position = instance.scheduler.requests[req_id].num_computed_tokens - 1
        assert num_tokens > 0
        slots.append((manager.get_block_ids(req_id)[position // BLOCK_SIZE], position % BLOCK_SIZE))
    return slots


def test_blocks_freed_under_a_step_in_flight_reach_a_read_only_after_it(
    pair: Callable[..., Instance],
) -> None:
    """pd_lessons 6 (vLLM PR #45357): with async scheduling, step N+1 is scheduled before step
    N's output comes back. A request aborted then gives back blocks that step N+1 still writes;
    the next step hands them to a remote read. The read is ordered by a later step than every
    write of the aborted request, and workers run steps in order (a step's output waits for
    its forward: the sampled tokens come back to the host), so the read's bytes are the
    prefill side's, exactly."""
    p = pair("kv_producer")
    d = pair("kv_consumer", num_blocks=4)  # 3 usable: the read can only get A's blocks
    prompt = [2000 + i for i in range(int(2.5 * BLOCK_SIZE))]
    params = prefill_for_decode(p, prompt, "b")

    a = make_request("a", prompt=int(2.5 * BLOCK_SIZE), max_tokens=8)
    d.scheduler.add_request(a)
    d.step()  # a's prefill: it holds all 3 blocks
    step_n = d.scheduler.schedule()
    step_n1 = d.scheduler.schedule()  # in flight beside step N
    writes_n1 = _last_slots(d, step_n1)
    a_blocks = d.block_ids(a)
    d.scheduler.finish_requests("a", ABORTED)  # the client went away: blocks free at once

    b = decode_request(params, prompt, "b")
    d.scheduler.add_request(b)
    step_n2 = d.scheduler.schedule()
    recv = connector_meta(step_n2).reqs_to_recv["b"]
    assert sorted(recv.local_block_ids) == sorted(a_blocks)  # the race is set up
    assert "a" not in step_n2.num_scheduled_tokens

    def forward(slots: list[tuple[int, int]]) -> Callable[[SchedulerOutput], None]:
        def write(_: SchedulerOutput) -> None:  # the aborted request's KV of this step
            for block, slot in slots:
                d.cache[block, :, :, slot] = 1e9

        return write

    # The workers run N, N+1, N+2 in order; the engine processes each output in turn.
    d.scheduler.update_from_output(step_n, d.execute(step_n))
    d.scheduler.update_from_output(step_n1, d.execute(step_n1, forward(writes_n1)))
    d.scheduler.update_from_output(step_n2, d.execute(step_n2))
    run_until_both_empty(p, d)
    assert torch.equal(d.cache[recv.local_block_ids], p.cache[params.remote_block_ids])


# ---- pd_lessons 7 ---------------------------------------------------------------------------


def test_prefill_request_preempted_in_its_last_step_hands_off_its_blocks(model: str) -> None:
    """pd_lessons 7 (vLLM PR #50297): with async scheduling, a remote-decode request's last
    prefill step is in flight when the next schedule() preempts it, freeing its blocks. The
    token that step samples is dropped: the request does not finish with an empty block
    list, it prefills again and then hands off every block of its prompt."""
    scheduler = create_scheduler(model, kv_role="kv_producer", num_blocks=4)  # 3 usable
    local = make_request("local", prompt=BLOCK_SIZE - 1, max_tokens=4)
    remote = create_request(1, 2 * BLOCK_SIZE, do_remote_decode=True)
    scheduler.add_request(local)
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(scheduler, out))
    scheduler.add_request(remote)
    step_n = scheduler.schedule()  # local's last slot of block 0, remote's whole prompt
    assert step_n.num_scheduled_tokens == {"local": 1, remote.request_id: 2 * BLOCK_SIZE}
    sampled_n = runner_output(scheduler, step_n)
    step_n1 = scheduler.schedule()  # local needs a block: remote, admitted last, is preempted
    assert remote.status == RequestStatus.PREEMPTED and step_n1.num_scheduled_tokens == {"local": 1}
    sampled_n1 = runner_output(scheduler, step_n1)

    handed_off = []
    for out, sampled in ((step_n, sampled_n), (step_n1, sampled_n1)):
        for output in scheduler.update_from_output(out, sampled):
            handed_off.append(output.kv_transfer_params)
    assert handed_off == [None, None] and not remote.is_finished()

    while remote.request_id in scheduler.requests and not remote.is_finished():
        out = scheduler.schedule()
        for output in scheduler.update_from_output(out, runner_output(scheduler, out)):
            if output.request_id == remote.request_id:
                handed_off.append(output.kv_transfer_params)
    params = handed_off[-1]
    assert params is not None
    assert params.remote_block_ids == scheduler.kv_cache_manager.get_block_ids(remote.request_id)
    assert len(params.remote_block_ids) == 2
    out = scheduler.schedule()
    scheduler.update_from_output(
        out, create_model_runner_output([], finished_sending={remote.request_id})
    )
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output(scheduler, out))
    scheduler.schedule()
    assert_scheduler_empty(scheduler)
