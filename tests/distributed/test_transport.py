"""KV transport between two real processes, for each backend: READ + notif, concurrent reads,
WRITE + notif (push mode), notifications both ways, descriptor checks, an owner killed before
or during reads or before a write, a reader killed while reading, and an idle transport's CPU."""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pdserve.kv_connector.transport import Desc, Transport, XferState, block_descs, make_transport
from tests.utils.transport_peer import PeerProcess, kv_pattern

BACKENDS = ["nixl", "ucx"]
NUM_BLOCKS, BLOCK_LEN = 256, 16 << 10
TIMEOUT_S = 3.0


def wait_done(t: Transport, handle: int, limit_s: float = 20.0) -> XferState:
    deadline = time.monotonic() + limit_s
    while (state := t.check_state(handle)) is XferState.PENDING:
        assert time.monotonic() < deadline, f"transfer {handle} still pending after {limit_s} s"
        time.sleep(0.001)
    return state


def expected(remote_ids: list[int], seed: int = 1) -> torch.Tensor:
    src = kv_pattern(NUM_BLOCKS, BLOCK_LEN, seed).view(NUM_BLOCKS, BLOCK_LEN)
    return src[remote_ids]


class Pair:
    """A reader transport here, and an owner transport in a child process that knows it."""

    def __init__(self, backend: str, name: str) -> None:
        self.owner = PeerProcess(
            backend, f"{name}-owner", NUM_BLOCKS, BLOCK_LEN, timeout_s=TIMEOUT_S
        )
        try:
            self.reader = make_transport(backend, f"{name}-reader", timeout_s=TIMEOUT_S)
        except BaseException:
            self.owner.close()
            raise
        self.kv = torch.zeros(NUM_BLOCKS, BLOCK_LEN, dtype=torch.uint8)
        self.reader.register_region(self.kv)
        self.remote = self.reader.add_remote_agent(self.owner.metadata)
        assert self.owner.call("add", self.reader.get_agent_metadata()) == f"{name}-reader"

    def close(self) -> None:
        try:
            self.reader.shutdown()
        finally:
            self.owner.close()


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param, f"t-{request.param}")
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(autouse=True)
def no_stale_notifs(request: pytest.FixtureRequest) -> None:
    if "pair" in request.fixturenames:
        p: Pair = request.getfixturevalue("pair")
        p.owner.call("notifs", 0, 0.0)
        p.reader.get_new_notifs()


def test_block_descs_coalesces_runs_consecutive_on_both_sides() -> None:
    local, remote = block_descs(0, [4, 5, 6, 9, 10, 2], 1, [7, 8, 9, 3, 5, 6], 100)
    assert local == [Desc(0, 400, 300), Desc(0, 900, 100), Desc(0, 1000, 100), Desc(0, 200, 100)]
    assert remote == [Desc(1, 700, 300), Desc(1, 300, 100), Desc(1, 500, 100), Desc(1, 600, 100)]
    assert block_descs(0, list(range(64)), 0, list(range(100, 164)), 16) == (
        [Desc(0, 0, 64 * 16)],
        [Desc(0, 1600, 64 * 16)],
    )
    assert block_descs(0, [], 0, [], 16) == ([], [])
    with pytest.raises(ValueError, match="2 local blocks but 1 remote"):
        block_descs(0, [1, 2], 0, [1], 16)


def test_make_transport_names_the_choices() -> None:
    with pytest.raises(ValueError, match="transport must be one of .nixl., .ucx."):
        make_transport("rdma", "x")


@pytest.mark.parametrize(
    "backend, libraries, package",
    # NIXL imports from the meta package where it is installed, else from the wheel's own module.
    [("nixl", ("nixl", "nixl_cu12"), "nixl-cu12"), ("ucx", ("ucxx",), "ucxx-cu12")],
)
def test_make_transport_without_its_library_names_the_package(
    backend: str, libraries: tuple[str, ...], package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for library in libraries:
        monkeypatch.setitem(sys.modules, library, None)  # None in sys.modules: import fails
    for module in ("nixl", "ucx", "ucx_service"):
        monkeypatch.delitem(sys.modules, f"pdserve.kv_connector.transport.{module}", raising=False)
    with pytest.raises(RuntimeError, match=package):
        make_transport(backend, "x")


@pytest.mark.parametrize("backend", BACKENDS)
def test_register_region_rejects_non_contiguous(backend: str) -> None:
    t = make_transport(backend, f"reg-{backend}")
    try:
        with pytest.raises(ValueError, match="contiguous"):
            t.register_region(torch.zeros(8, 8, dtype=torch.uint8).t())
        assert t.register_region(torch.zeros(4, dtype=torch.bfloat16)) == 0
        assert t.register_region(torch.zeros(4, dtype=torch.float32)) == 1
    finally:
        t.shutdown()
        t.shutdown()


@pytest.mark.timeout(60)
def test_read_permuted_blocks_and_owner_gets_notif(pair: Pair) -> None:
    rng = random.Random(0)
    local_ids = list(range(NUM_BLOCKS))
    # A long run consecutive on both sides, then the rest scattered.
    remote_ids = list(range(100, 164)) + rng.sample(
        [b for b in range(NUM_BLOCKS) if not 100 <= b < 164], NUM_BLOCKS - 64
    )
    local, remote = block_descs(0, local_ids, 0, remote_ids, BLOCK_LEN)
    assert local[0] == Desc(0, 0, 64 * BLOCK_LEN) and len(local) < NUM_BLOCKS - 60
    pair.kv.zero_()
    assert pair.reader.add_remote_agent(pair.owner.metadata) == pair.remote  # idempotent
    handle = pair.reader.read(pair.remote, local, remote, b"req-1")
    assert wait_done(pair.reader, handle) is XferState.DONE
    pair.reader.release(handle)
    assert torch.equal(pair.kv, expected(remote_ids))
    assert pair.owner.call("notifs", 1, 10.0) == [(pair.reader.agent_name, b"req-1")]


@pytest.mark.timeout(60)
def test_concurrent_reads_each_notif_exactly_once(pair: Pair) -> None:
    pair.kv.zero_()
    n, per = 8, NUM_BLOCKS // 8
    rng = random.Random(1)
    sources = [rng.sample(range(NUM_BLOCKS), per) for _ in range(n)]
    handles = []
    for i, src in enumerate(sources):
        local, remote = block_descs(0, range(i * per, (i + 1) * per), 0, src, BLOCK_LEN)
        handles.append(pair.reader.read(pair.remote, local, remote, f"req-{i}".encode()))
    assert all(wait_done(pair.reader, h) is XferState.DONE for h in handles)
    assert torch.equal(pair.kv, expected([b for src in sources for b in src]))
    notifs = pair.owner.call("notifs", n, 10.0) + pair.owner.call("notifs", n, 0.3)
    assert sorted(notifs) == sorted((pair.reader.agent_name, f"req-{i}".encode()) for i in range(n))


@pytest.mark.timeout(60)
def test_write_permuted_blocks_lands_before_the_notif(pair: Pair) -> None:
    rng = random.Random(2)
    pair.kv.copy_(kv_pattern(NUM_BLOCKS, BLOCK_LEN, 9).view(NUM_BLOCKS, BLOCK_LEN))
    local_ids = rng.sample(range(NUM_BLOCKS), 48)
    remote_ids = list(range(10, 42)) + rng.sample(range(64, NUM_BLOCKS), 16)
    local, remote = block_descs(0, local_ids, 0, remote_ids, BLOCK_LEN)
    handles = [
        pair.reader.write(pair.remote, local, remote, b"pushed-1"),
        # An empty notif: the bytes land, the owner hears nothing of this one.
        pair.reader.write(pair.remote, local[:1], [Desc(0, 0, local[0].length)], b""),
    ]
    assert [wait_done(pair.reader, h) for h in handles] == [XferState.DONE] * 2
    for h in handles:
        pair.reader.release(h)
    # DONE means every byte is in the owner's memory, and its notif is there.
    assert pair.owner.call("notifs", 1, 10.0) == [(pair.reader.agent_name, b"pushed-1")]
    sent = pair.kv.view(NUM_BLOCKS, BLOCK_LEN)
    assert torch.equal(pair.owner.call("blocks", remote_ids), sent[local_ids])
    untouched = [b for b in range(42, 64) if b not in remote_ids]
    assert torch.equal(pair.owner.call("blocks", untouched), expected(untouched))
    assert pair.owner.call("notifs", 1, 0.3) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_target_killed_before_write_gives_error(backend: str) -> None:
    p = Pair(backend, f"kw-{backend}")
    try:
        p.owner.kill()
        local, remote = block_descs(0, range(8), 0, range(8), BLOCK_LEN)
        handle = p.reader.write(p.remote, local, remote, b"never")
        assert wait_done(p.reader, handle, TIMEOUT_S + 5) is XferState.ERROR
        p.reader.release(handle)
    finally:
        p.close()


@pytest.mark.timeout(60)
def test_send_notif_both_ways(pair: Pair) -> None:
    pair.reader.send_notif(pair.remote, b"ping")
    assert pair.owner.call("notifs", 1, 10.0) == [(pair.reader.agent_name, b"ping")]
    pair.owner.call("notify", pair.reader.agent_name, b"pong")
    deadline = time.monotonic() + 10.0
    got: list[tuple[str, bytes]] = []
    while not got and time.monotonic() < deadline:
        got = pair.reader.get_new_notifs()
        time.sleep(0.005)
    assert got == [(pair.remote, b"pong")]


def test_bad_descriptors_raise_before_sending(pair: Pair) -> None:
    r, ok = pair.reader, Desc(0, 0, BLOCK_LEN)
    end = NUM_BLOCKS * BLOCK_LEN
    bad = [
        ([Desc(0, end - 8, BLOCK_LEN)], [ok], "local range"),
        ([ok], [Desc(0, end, BLOCK_LEN)], "remote range"),
        ([ok], [Desc(1, 0, BLOCK_LEN)], "remote region 1"),
        ([ok], [Desc(0, 0, 8)], "local length"),
        ([ok, ok], [ok], "2 local descriptors but 1"),
        ([], [], "at least one"),
        ([Desc(0, -8, BLOCK_LEN)], [ok], "local range"),
    ]
    for local, remote, match in bad:
        for post in (r.read, r.write):
            with pytest.raises(ValueError, match=match):
                post(pair.remote, local, remote, b"bad")
    with pytest.raises(ValueError, match="unknown agent"):
        r.read("nobody", [ok], [ok], b"bad")
    with pytest.raises(ValueError, match="unknown agent"):
        r.send_notif("nobody", b"bad")
    assert pair.owner.call("notifs", 1, 0.3) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_owner_killed_before_read_gives_error(backend: str) -> None:
    p = Pair(backend, f"kb-{backend}")
    try:
        p.owner.kill()
        local, remote = block_descs(0, range(8), 0, range(8), BLOCK_LEN)
        handle = p.reader.read(p.remote, local, remote, b"never")
        # Within the transport's timeout (the bound is the wait's, not an assertion on speed).
        assert wait_done(p.reader, handle, TIMEOUT_S + 5) is XferState.ERROR
        p.reader.release(handle)
    finally:
        p.close()


# (backend, UCX_TLS or None for the library's default). NIXL's UCX picks CMA between two local
# processes where the kernel allows it: its GET is one-sided (process_vm_readv), so a frozen
# owner does not hold it up. Without CMA every GET needs the owner's progress.
FROZEN_OWNER_CASES = [("ucx", None), ("nixl", None), ("nixl", "^cma")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("backend", "tls"), FROZEN_OWNER_CASES, ids=["ucx", "nixl", "nixl-no-cma"])
def test_owner_killed_during_a_read_gives_error(
    backend: str, tls: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A READ posted to a frozen owner ends when the owner is killed: in ERROR if it needed the
    owner (in flight for sure at the kill), or DONE with every byte if it was one-sided."""
    if tls is not None:
        monkeypatch.setenv("UCX_TLS", tls)  # read by the reader's UCX and the owner's at spawn
    p = Pair(backend, f"kd-{backend}")
    try:
        ids = list(range(NUM_BLOCKS))
        local, remote = block_descs(0, ids, 0, ids, BLOCK_LEN)
        # A first READ wires both endpoints up, so which kind of GET the frozen owner sees
        # depends on the transports alone, not on how far the connection got.
        warm = p.reader.read(p.remote, local, remote, b"warm")
        assert wait_done(p.reader, warm) is XferState.DONE
        p.reader.release(warm)
        p.kv.zero_()
        p.owner.freeze()
        handle = p.reader.read(p.remote, local, remote, b"x")
        time.sleep(0.2)  # what a one-sided GET needs, many times over
        one_sided = p.reader.check_state(handle) is XferState.DONE
        if backend == "ucx" or tls == "^cma":  # these configurations have no one-sided GET
            assert not one_sided
        if one_sided:
            assert torch.equal(p.kv, expected(ids))
        p.owner.kill()
        assert wait_done(p.reader, handle, TIMEOUT_S + 5) is (
            XferState.DONE if one_sided else XferState.ERROR
        )
        p.reader.release(handle)
        # The dead owner fails every later read at once.
        later = p.reader.read(p.remote, local, remote, b"y")
        assert wait_done(p.reader, later, TIMEOUT_S + 5) is XferState.ERROR
    finally:
        p.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reader_killed_while_reading_owner_keeps_serving(backend: str) -> None:
    owner = make_transport(backend, f"rk-{backend}-owner", timeout_s=TIMEOUT_S)
    src = kv_pattern(NUM_BLOCKS, BLOCK_LEN, 7)
    owner.register_region(src)
    child = PeerProcess(backend, f"rk-{backend}-reader", NUM_BLOCKS, BLOCK_LEN, timeout_s=TIMEOUT_S)
    late = make_transport(backend, f"rk-{backend}-late", timeout_s=TIMEOUT_S)
    try:
        owner.add_remote_agent(child.metadata)
        child.call("add", owner.get_agent_metadata())
        child.call("read_forever", owner.agent_name, NUM_BLOCKS * BLOCK_LEN)
        deadline = time.monotonic() + 10.0
        while not owner.get_new_notifs():  # the child is reading in a loop
            assert time.monotonic() < deadline
            time.sleep(0.01)
        child.kill()
        # At once: whatever the dead reader left half-sent must not hold up another reader.
        dst = torch.zeros_like(src)
        late.register_region(dst)
        name = late.add_remote_agent(owner.get_agent_metadata())
        handle = late.read(name, [Desc(0, 0, src.numel())], [Desc(0, 0, src.numel())], b"late")
        assert wait_done(late, handle) is XferState.DONE and torch.equal(dst, src)
    finally:
        late.shutdown()
        child.close()
        owner.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_idle_transport_uses_almost_no_cpu(backend: str) -> None:
    t = make_transport(backend, f"idle-{backend}")
    try:
        t.register_region(torch.zeros(1 << 16, dtype=torch.uint8))
        time.sleep(0.2)
        before = time.process_time()  # every thread of this process; the test itself sleeps
        time.sleep(1.0)
        assert time.process_time() - before < 0.03
    finally:
        t.shutdown()


def test_ucx_drops_malformed_messages(caplog: pytest.LogCaptureFixture) -> None:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array

    from pdserve.kv_connector.transport import ucx_messages as wire

    a, b = make_transport("ucx", "mal-a"), make_transport("ucx", "mal-b")
    ctx = ucx_api.UCXContext({"TLS": "self,posix"}, (ucx_api.Feature.TAG,))
    worker = ucx_api.UCXWorker(ctx)
    try:
        src = torch.arange(4096, dtype=torch.int32)
        dst = torch.zeros(4096, dtype=torch.int32)
        b.register_region(src)
        a.register_region(dst)
        b_address = wire.decode_metadata(b.get_agent_metadata()).address
        address = ucx_api.UCXAddress.create_from_buffer(b_address)
        ep = worker.create_endpoint_from_worker_address(address, False)
        garbage = np.frombuffer(b"\x93\xa5junk\x01", np.uint8)
        with caplog.at_level(logging.WARNING):
            req = ep.tag_send(Array(garbage), ucx_api.UCXXTag(wire.CTRL_TAG))
            while not req.completed:
                worker.progress()
            name = a.add_remote_agent(b.get_agent_metadata())
            handle = a.read(name, [Desc(0, 0, 16384)], [Desc(0, 0, 16384)], b"after-junk")
            assert wait_done(a, handle) is XferState.DONE
        assert torch.equal(src, dst)
        assert "malformed control message dropped" in caplog.text
        # The owner records the notification when its sends complete, which may trail the
        # reader's DONE by a moment.
        notifs: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + 10
        while not notifs and time.monotonic() < deadline:
            notifs = b.get_new_notifs()
            time.sleep(0.01)
        assert notifs == [("mal-a", b"after-junk")]
    finally:
        a.shutdown()
        b.shutdown()
        del worker, ctx
