"""The prefill side's lease, seen from both halves of the NixlConnector: heartbeats from a decode
request's arrival, paced by the prefill engine's lease, a handshake for an engine a queued
request waits for, the lease board that fails a late read, the board's bounded slots, an
epoch change that handshakes again, and a TP layout refused at the handshake. Real connector
halves, in this process (tests/unit/kv_connector/halves.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch

from pdserve.kv_connector.nixl import handshaker as nixl_handshaker
from pdserve.kv_connector.nixl import lease as nixl_lease
from pdserve.kv_connector.nixl import scheduler as nixl_scheduler
from pdserve.kv_connector.nixl import scheduler_leases as nixl_leases
from pdserve.kv_connector.nixl.handshake import HandshakeServer
from pdserve.kv_connector.nixl.metadata import (
    LeaseStamp,
    NixlConnectorMetadata,
    RecvReqMeta,
    RemoteAddress,
)
from pdserve.kv_connector.nixl.worker import NixlConnectorWorker
from pdserve.kv_transfer_params import KVTransferParams, RemoteLease
from pdserve.request import FinishReason, Request, RequestStatus
from tests.unit.scheduler.conftest import make_request

from .halves import Instance, cache, kv_config, poll
from .utils import (
    assert_scheduler_empty,
    connector_meta,
    create_request,
    create_scheduler,
    step,
)

pytestmark = pytest.mark.timeout(120)

LEASE = 30.0


class Clock:
    """time.time / time.monotonic of the connector modules, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> object:  # perf_counter: the real one
        import time

        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(nixl_handshaker, "time", clock)
    monkeypatch.setattr(nixl_lease, "time", clock)
    monkeypatch.setattr(nixl_scheduler, "time", clock)
    monkeypatch.setattr(nixl_leases, "time", clock)
    return clock


@pytest.fixture
def instances(model: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Instance]]:
    made: list[Instance] = []

    def make(role: str, **kwargs: Any) -> Instance:
        made.append(Instance(model, role, monkeypatch, **kwargs))
        return made[-1]

    yield make
    for instance in made:
        instance.shutdown()


def _remote(request: Request, seconds: float) -> Request:
    assert request.kv_transfer_params is not None
    request.kv_transfer_params = msgspec.structs.replace(
        request.kv_transfer_params, remote_lease=RemoteLease(0, 5, seconds)
    )
    return request


def test_queued_request_heartbeats_from_arrival_at_its_engines_pace(
    model: str, clock: Clock
) -> None:
    """pd_lessons 3: with every seat taken, a decode request waits for admission; its
    heartbeats start when it arrives (not when it is admitted), come every sixth of the lease
    its prefill engine named, say where that engine answers, and end with its read."""
    scheduler = create_scheduler(model, max_num_seqs=1)
    busy = make_request("busy", prompt=8, max_tokens=100)
    scheduler.add_request(busy)
    step(scheduler, [busy])
    queued = _remote(create_request(1, 20, do_remote_prefill=True), seconds=3)
    scheduler.add_request(queued)
    beats = []
    for _ in range(4):
        meta = connector_meta(step(scheduler, [busy]))
        assert not meta.reqs_to_recv, "admitted while every seat is taken"
        beats.append((meta.heartbeats, meta.remote_engines))
        clock.now += 0.25
    beat = ({"my-engine-id": ["prefill-1"]}, {"my-engine-id": RemoteAddress("my-host", 1234, 1)})
    assert beats == [beat, ({}, {})] * 2
    scheduler.finish_requests(busy.request_id, RequestStatus.FINISHED_ABORTED)
    clock.now += 1
    meta = connector_meta(step(scheduler, []))
    assert list(meta.reqs_to_recv) == [queued.request_id]
    # Aborted while its READ is in flight: the READ still holds the prefill side's blocks.
    scheduler.finish_requests(queued.request_id, RequestStatus.FINISHED_ABORTED)
    clock.now += 1
    assert connector_meta(step(scheduler, [])).heartbeats == {"my-engine-id": ["prefill-1"]}
    step(scheduler, [], finished_recving={queued.request_id})
    clock.now += 1
    assert connector_meta(step(scheduler, [])).heartbeats == {}
    assert_scheduler_empty(scheduler)


def test_lease_board_slots_are_bounded_and_cleared(model: str) -> None:
    """A prefill request takes a board slot at admission; with none free it waits. A slot
    comes back when the lease ends (the workers cleared it) or, cleared by an order, when the
    request will not be read."""
    scheduler = create_scheduler(model, kv_role="kv_producer")
    board = scheduler.connector.board
    board.size(1)
    first, second = (create_request(i, 20, do_remote_decode=True) for i in (1, 2))
    scheduler.add_request(first)
    scheduler.add_request(second)
    out = step(scheduler, [first])
    stamps = connector_meta(out).lease_stamps
    assert list(stamps) == [first.request_id] and stamps[first.request_id].slot == 0
    assert second.status == RequestStatus.WAITING  # no slot: not admitted
    tag = stamps[first.request_id].tag
    assert first.is_finished()
    step(scheduler, [], finished_sending={first.request_id})
    out = step(scheduler, [second])
    stamps = connector_meta(out).lease_stamps
    assert stamps[second.request_id].slot == 0 and stamps[second.request_id].tag != tag
    step(scheduler, [], finished_sending={second.request_id})
    # Longer than a step's budget: aborted after its slot was written, before it finished
    # (so before any reader could have its params): an order clears the slot.
    third = create_request(3, 100, do_remote_decode=True)
    scheduler.add_request(third)
    stamps = connector_meta(step(scheduler, [])).lease_stamps
    assert stamps[third.request_id].tag != 0
    scheduler.finish_requests(third.request_id, RequestStatus.FINISHED_ABORTED)
    stamps = connector_meta(scheduler.schedule()).lease_stamps
    assert stamps[third.request_id] == LeaseStamp(0, 0)
    assert board.has_room()


def _prefill(p: Instance, prompt: list[int], req_id: str) -> dict[str, Any]:
    request = make_request(req_id, prompt=prompt, max_tokens=1)
    request.kv_transfer_params = KVTransferParams(do_remote_decode=True)
    p.scheduler.add_request(request)
    _, outputs = p.step()
    (output,) = outputs
    assert output.kv_transfer_params
    return output.kv_transfer_params


def _decode(d: Instance, params: KVTransferParams, prompt: list[int], req_id: str) -> Request:
    request = make_request(req_id, prompt=prompt, max_tokens=2)
    request.kv_transfer_params = msgspec.structs.replace(params)
    d.scheduler.add_request(request)
    return request


def _run(p: Instance, *requests: Request, d: Instance) -> None:
    def ended() -> bool:
        d.step()
        p.step()
        return all(r.is_finished() for r in requests) and not d.scheduler.requests

    poll(ended)


def test_read_after_the_lease_ended_fails_not_another_requests_kv(
    instances: Callable[..., Instance], clock: Clock
) -> None:
    """pd_lessons 9: the lease expires unread and the prefill side gives the blocks to another
    request, which writes its KV there; the late reader's READ brings that KV, but the lease
    check finds its slot cleared and the load fails. A reader in time reads its own bytes."""
    p, d = instances("kv_producer"), instances("kv_consumer")
    prompt = list(range(100, 130))  # 2 blocks
    params = _prefill(p, prompt, "late")
    clock.now += LEASE + 1
    p.step()  # the lease expires unread: the blocks are free
    assert not p.scheduler.requests
    # Another request took them and wrote its KV.
    p.cache[params.remote_block_ids] = -1.0
    late = _decode(d, params, prompt, "late")
    _run(p, late, d=d)
    assert late.get_finished_reason() == FinishReason.ERROR
    assert d.connector.get_stats()["failed_transfers"] == 1

    prompt = list(range(300, 330))
    on_time = _decode(d, _prefill(p, prompt, "on-time"), prompt, "on-time")
    out, _ = d.step()
    recv = connector_meta(out).reqs_to_recv[on_time.request_id]
    _run(p, on_time, d=d)
    assert on_time.get_finished_reason() == FinishReason.LENGTH
    assert torch.equal(d.cache[recv.local_block_ids], p.cache[recv.remote_block_ids])


def test_restarted_engine_is_handshaked_again(
    instances: Callable[..., Instance], clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """pd_lessons 20: a prefill engine comes back with the same engine id (and a new epoch):
    the decode worker's first read for the new instance handshakes again instead of reading
    through the old agent."""
    p, d = instances("kv_producer"), instances("kv_consumer")
    prompt = list(range(100, 120))
    first = _decode(d, _prefill(p, prompt, "a"), prompt, "a")
    _run(p, first, d=d)
    p.shutdown()
    p = instances("kv_producer")  # engine id "prefill" again
    prompt = list(range(300, 320))
    params = _prefill(p, prompt, "b")
    assert params.remote_epoch != first.kv_transfer_params.remote_epoch  # type: ignore[index]
    with caplog.at_level(logging.WARNING):
        second = _decode(d, params, prompt, "b")
        _run(p, second, d=d)
    assert second.get_finished_reason() == FinishReason.LENGTH
    assert "handshaking again" in caplog.text
    assert "failed_transfers" not in d.connector.get_stats()


@pytest.fixture
def worker(model: str) -> Iterator[Callable[..., NixlConnectorWorker]]:
    made: list[NixlConnectorWorker] = []

    def make(role: str, tp: int = 1, heads: int = 2) -> NixlConnectorWorker:
        engine_id = "prefill" if role == "kv_producer" else "decode"
        config = kv_config(model, role, engine_id, tp=tp, kv_lease_duration=LEASE)
        made.append(NixlConnectorWorker(config, 0))
        made[-1].register_kv_caches(cache(12, role == "kv_producer", num_kv_heads=heads))
        return made[-1]

    yield make
    for w in made:
        w.shutdown()


def test_heartbeat_for_an_unknown_engine_handshakes_first(
    worker: Callable[..., NixlConnectorWorker], clock: Clock
) -> None:
    """A request queued before its first read from an engine: its first heartbeat makes the
    decode worker handshake, and the next one reaches the prefill side and extends the lease."""
    p, d = worker("kv_producer"), worker("kv_consumer")
    server = HandshakeServer("127.0.0.1", 0, {0: p.get_handshake_metadata()})
    try:
        start = clock.now
        p.bind(NixlConnectorMetadata(reqs_to_send={"p-1": start + LEASE, "p-2": start + LEASE}))
        p.start_load_kv()
        address = RemoteAddress("127.0.0.1", server.port, 1)
        d.bind(
            NixlConnectorMetadata(
                heartbeats={"prefill": ["p-1"]}, remote_engines={"prefill": address}
            )
        )
        d.start_load_kv()
        # No read asked for it: only the heartbeat can have made the engine known.
        poll(lambda: d.get_finished() == (None, None) and "prefill" in d.handshaker.engines)
        clock.now = start + LEASE - 1
        # The heartbeat first; the empty read's `done` after it marks its arrival.
        d.bind(
            NixlConnectorMetadata(
                heartbeats={"prefill": ["p-1"]},
                reqs_to_recv={
                    "d-2": RecvReqMeta([], [0], "prefill", "p-2", "127.0.0.1", server.port, 1)
                },
            )
        )
        d.start_load_kv()
        poll(lambda: d.get_finished()[1] == {"d-2"})
        poll(lambda: p.get_finished()[0] == {"p-2"})
        clock.now = start + LEASE + 1  # past the first expiry: renewed to 2/3 lease on
        assert p.get_finished() == (None, None)
        assert "handshake_failures" not in d.take_stats()
    finally:
        server.close()


def test_tp_layout_that_cannot_pair_fails_at_the_handshake(
    worker: Callable[..., NixlConnectorWorker], caplog: pytest.LogCaptureFixture
) -> None:
    """pd_lessons 25: a prefill TP the decode TP does not divide (nor it the other) is refused
    at the handshake, with the reason, before anything is asked of the peer."""
    d = worker("kv_consumer", tp=2, heads=1)
    meta = RecvReqMeta([1], [0], "prefill", "p-1", "127.0.0.1", 1, 3)
    with caplog.at_level(logging.ERROR):
        d.bind(NixlConnectorMetadata(reqs_to_recv={"d-1": meta}))
        d.start_load_kv()
        poll(lambda: d.get_finished()[1] == {"d-1"})
    assert d.take_invalid_block_ids() == {1}
    assert d.take_stats() == {"handshake_failures": 1, "failed_transfers": 1}
    assert "decode TP 2 does not divide prefill TP 3" in caplog.text
    assert d.take_load_errors() == {
        "d-1": "the KV handshake with prefill engine prefill failed: decode TP 2 does not "
        "divide prefill TP 3"
    }
