"""Push mode (NixlPushConnector) with its real halves over a real transport: the decode side
registers the blocks it lacks, the prefill side writes each block once it is final, both sides
end with their pools full, on every path (docs/push.md; pd_lessons 22, 24)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pdserve.kv_transfer_params import KVTransferParams
from pdserve.request import Request, RequestStatus
from tests.unit.scheduler.conftest import make_request

from .halves import BLOCK_SIZE, Instance, poll
from .utils import assert_scheduler_empty

pytestmark = pytest.mark.timeout(120)
transports = pytest.mark.parametrize("transport", ["nixl", "ucx"])


@pytest.fixture
def make(model: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    made: list[Instance] = []

    def instance(role: str, transport: str, **extra: Any) -> Instance:
        inst = Instance(model, role, monkeypatch, transport=transport, push=True, **extra)
        made.append(inst)
        return inst

    yield instance
    for inst in made:
        inst.shutdown()


def prompt(n: int, base: int = 100) -> list[int]:
    return [base + i for i in range(n)]


def prefill_request(tokens: list[int], transfer_id: str = "t1") -> Request:
    request = make_request("p-" + transfer_id, tokens, max_tokens=1)
    request.kv_transfer_params = KVTransferParams(do_remote_decode=True, transfer_id=transfer_id)
    return request


def decode_request(tokens: list[int], p: Instance, transfer_id: str = "t1") -> Request:
    request = make_request("d-" + transfer_id, tokens, max_tokens=4)
    request.kv_transfer_params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=p.engine_id,
        remote_request_id=transfer_id,
        remote_host="127.0.0.1",
        remote_port=p.port,
        tp_size=1,
    )
    return request


# Request id -> the error its EngineCoreOutput gave, over every step run_until took.
ERRORS: dict[str, str] = {}


def run_until(done: Any, *instances: Instance) -> None:
    """Step every instance until `done()`; the test's timeout bounds it."""

    def one_round() -> bool:
        for inst in instances:
            for output in inst.step()[1]:
                if output.error:
                    ERRORS[output.request_id] = output.error
        return bool(done())

    poll(one_round)


def finish(*instances: Instance, expired_leases: int = 0) -> None:
    """Run until no instance has work left, then check every pool is full and that the release
    each test names freed it, not a lease (30 s later, it would free the same blocks)."""
    run_until(
        lambda: (
            not any(
                i.scheduler.has_unfinished_requests() or i.connector.has_pending_transfers()
                for i in instances
            )
        ),
        *instances,
    )
    for inst in instances:
        inst.step()
        assert_scheduler_empty(inst.scheduler)
    expired = sum(i.connector.get_stats().get("expired_leases", 0) for i in instances)
    assert expired == expired_leases, f"{expired} leases expired"


def landed(p: Instance, d: Instance, p_blocks: list[int], d_blocks: list[int]) -> bool:
    return torch.equal(d.cache[d_blocks], p.cache[p_blocks])


@transports
@pytest.mark.parametrize("decode_first", [True, False], ids=["decode-first", "prefill-first"])
def test_push_lands_every_block_either_arrival_order(
    make: Any, transport: str, decode_first: bool
) -> None:
    p, d = make("kv_producer", transport), make("kv_consumer", transport)
    tokens = prompt(int(2.5 * BLOCK_SIZE))
    dreq, preq = decode_request(tokens, p), prefill_request(tokens)
    first, second = ((d, dreq), (p, preq)) if decode_first else ((p, preq), (d, dreq))
    first[0].scheduler.add_request(first[1])
    first[0].step()
    second[0].scheduler.add_request(second[1])
    d_blocks: list[int] = []
    p_blocks: list[int] = []

    def d_running() -> bool:
        nonlocal d_blocks, p_blocks
        if preq.request_id in p.scheduler.requests:
            p_blocks = p.block_ids(preq) or p_blocks
        d_blocks = d.block_ids(dreq) or d_blocks
        return dreq.status == RequestStatus.RUNNING or dreq.is_finished()

    run_until(d_running, p, d)
    # The whole prompt arrived: the decode side recomputes its last token only.
    assert dreq.num_computed_tokens >= len(tokens) - 1
    assert len(d_blocks) == len(p_blocks) == 3 and landed(p, d, p_blocks, d_blocks)
    stats = d.connector.get_stats()
    assert stats["transfers"] == 1 and stats["transfer_bytes"] == 3 * p.cache[0].nbytes
    finish(p, d)
    assert p.connector.get_stats()["pushes"] == 1


@transports
def test_decode_side_prefix_hit_registers_only_the_tail(make: Any, transport: str) -> None:
    """pd_lessons 22: the blocks the decode side lacks are the prompt's last ones."""
    p, d = make("kv_producer", transport), make("kv_consumer", transport)
    tokens = prompt(4 * BLOCK_SIZE + 5)
    # The decode instance computed the first two blocks for an earlier request.
    warm = make_request("warm", tokens[: 2 * BLOCK_SIZE + 3], max_tokens=1)
    d.scheduler.add_request(warm)
    run_until(lambda: warm.is_finished(), d)
    dreq, preq = decode_request(tokens, p), prefill_request(tokens)
    d.scheduler.add_request(dreq)
    p.scheduler.add_request(preq)
    p_blocks: list[int] = []

    def d_running() -> bool:
        nonlocal p_blocks
        if preq.request_id in p.scheduler.requests:
            p_blocks = p.block_ids(preq) or p_blocks
        return dreq.status == RequestStatus.RUNNING

    run_until(d_running, p, d)
    d_blocks = d.block_ids(dreq)
    assert landed(p, d, p_blocks[2:], d_blocks[2:])
    # Written: the three blocks beyond the hit, not the two it covers.
    assert d.connector.get_stats()["transfer_bytes"] == 3 * p.cache[0].nbytes
    finish(p, d)


@transports
def test_a_short_rest_is_computed_on_the_decode_side_without_waiting(
    make: Any, transport: str
) -> None:
    p, d = make("kv_producer", transport), make("kv_consumer", transport)
    tokens = prompt(3 * BLOCK_SIZE + 4)
    warm = make_request("warm", tokens, max_tokens=1)
    d.scheduler.add_request(warm)
    run_until(lambda: warm.is_finished(), d)
    dreq = decode_request(tokens, p)
    d.scheduler.add_request(dreq)
    out, _ = d.step()
    # Admitted at once with the local hit: no push is awaited.
    assert out.num_scheduled_tokens == {dreq.request_id: 4}
    preq = prefill_request(tokens)
    p.scheduler.add_request(preq)
    finish(p, d)  # the prefill side heard that nothing is needed, and freed
    assert "transfers" not in d.connector.get_stats()


@transports
def test_chunked_prefill_pushes_blocks_before_the_prompt_is_done(make: Any, transport: str) -> None:
    p, d = make("kv_producer", transport), make("kv_consumer", transport)
    tokens = prompt(10 * BLOCK_SIZE)  # 160 tokens: three steps of 64 on the prefill side
    dreq, preq = decode_request(tokens, p), prefill_request(tokens)
    d.scheduler.add_request(dreq)
    receiver = d.worker.receiver
    assert receiver is not None
    run_until(lambda: receiver.has_work(), d)  # handshaken, registered
    sender = p.worker.sender
    assert sender is not None
    run_until(lambda: sender.has_work(), p)  # the registration arrived
    p.scheduler.add_request(preq)
    pushed = 0
    for _ in range(200):
        p.step()
        d.step()
        pushed = p.connector.get_stats().get("transfer_bytes", 0)
        if pushed:
            break
    # The first chunk's four blocks went out while the prompt was still computing.
    assert preq.num_computed_tokens < len(tokens) and pushed == 4 * p.cache[0].nbytes
    p_blocks: list[int] = []

    def d_running() -> bool:
        nonlocal p_blocks
        p_blocks = p.block_ids(preq) or p_blocks
        return dreq.status == RequestStatus.RUNNING

    run_until(d_running, p, d)
    assert landed(p, d, p_blocks, d.block_ids(dreq))
    finish(p, d)


@transports
def test_decode_abort_after_registration_stops_the_writes(make: Any, transport: str) -> None:
    p, d = make("kv_producer", transport), make("kv_consumer", transport)
    tokens = prompt(2 * BLOCK_SIZE)
    dreq = decode_request(tokens, p)
    d.scheduler.add_request(dreq)
    receiver = d.worker.receiver
    assert receiver is not None
    run_until(lambda: receiver.has_work(), d)  # handshaken, registered
    sender = p.worker.sender
    assert sender is not None
    run_until(lambda: sender.has_work(), p)  # the registration arrived
    d.scheduler.finish_requests(dreq.request_id, RequestStatus.FINISHED_ABORTED)
    # Its blocks stay until the prefill side said it stopped writing.
    assert d.connector.has_pending_transfers()
    preq = prefill_request(tokens)
    p.scheduler.add_request(preq)
    finish(p, d)
    assert p.connector.get_stats().get("failed_pushes") == 1


@transports
def test_decode_abort_before_its_registration_went_out(make: Any, transport: str) -> None:
    p, d = make("kv_producer", transport), make("kv_consumer", transport)
    tokens = prompt(2 * BLOCK_SIZE)
    dreq = decode_request(tokens, p)
    d.scheduler.add_request(dreq)
    d.step()  # admitted; its handshake has not finished
    d.scheduler.finish_requests(dreq.request_id, RequestStatus.FINISHED_ABORTED)
    preq = prefill_request(tokens)
    p.scheduler.add_request(preq)
    finish(p, d)
    assert "transfers" not in d.connector.get_stats()


@transports
def test_decode_abort_before_admission_frees_the_prefill_side(make: Any, transport: str) -> None:
    p, d = make("kv_producer", transport), make("kv_consumer", transport)
    tokens = prompt(2 * BLOCK_SIZE)
    preq = prefill_request(tokens)
    p.scheduler.add_request(preq)
    run_until(lambda: preq.is_finished(), p)
    assert p.connector.has_pending_transfers()  # its blocks wait for the push
    dreq = decode_request(tokens, p)
    d.connector.release_remote(dreq.request_id, dreq.kv_transfer_params)  # aborted unseen
    finish(p, d)


@transports
def test_prefill_abort_fails_the_push(make: Any, transport: str) -> None:
    p, d = make("kv_producer", transport), make("kv_consumer", transport)
    tokens = prompt(2 * BLOCK_SIZE)
    dreq = decode_request(tokens, p)
    d.scheduler.add_request(dreq)
    d.step()
    preq = prefill_request(tokens)
    p.scheduler.add_request(preq)
    p.scheduler.finish_requests(preq.request_id, RequestStatus.FINISHED_ABORTED)
    run_until(lambda: dreq.is_finished(), p, d)
    assert dreq.status == RequestStatus.FINISHED_ERROR
    assert "aborted on the prefill instance" in ERRORS[dreq.request_id]
    finish(p, d)


@transports
def test_a_registration_that_never_comes_ends_with_the_lease(make: Any, transport: str) -> None:
    p = make("kv_producer", transport, kv_lease_duration=0.5)
    preq = prefill_request(prompt(2 * BLOCK_SIZE))
    p.scheduler.add_request(preq)
    finish(p, expired_leases=1)


@transports
def test_a_silent_prefill_side_fires_the_watchdog(make: Any, transport: str) -> None:
    p = make("kv_producer", transport)
    d = make("kv_consumer", transport, kv_lease_duration=0.5)
    dreq = decode_request(prompt(2 * BLOCK_SIZE), p)
    d.scheduler.add_request(dreq)
    # The prefill instance answers the handshake, then never gets the request and is not
    # stepped: no write, no word.
    run_until(lambda: dreq.is_finished(), d)
    assert "sent no word" in ERRORS[dreq.request_id]
    finish(d)
    assert d.connector.get_stats()["push_watchdogs"] == 1
