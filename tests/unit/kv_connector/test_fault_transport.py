"""The fault-injecting transport around each real one, both ends in this process: every point
and action of a plan does what docs/transport.md says, a plan is re-read when it changes, and
nothing is wrapped unless PDSERVE_KV_FAULT_PLAN names a plan."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdserve.kv_connector.transport import Desc, Transport, XferState, make_transport
from pdserve.kv_connector.transport.fault import FaultTransport
from tests.utils.faults import FaultPlan, rule

NUM_BLOCKS, BLOCK_LEN = 8, 4096
TIMEOUT_S = 1.0
DESCS = [Desc(0, 0, NUM_BLOCKS * BLOCK_LEN)]


class Pair:
    def __init__(self, backend: str, plan: FaultPlan, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("PDSERVE_KV_FAULT_PLAN", str(plan.path))
        self.plan = plan
        self.owner = make_transport(backend, f"f-{backend}-owner", timeout_s=TIMEOUT_S)
        self.reader = make_transport(backend, f"f-{backend}-reader", timeout_s=TIMEOUT_S)
        self.src = torch.randint(0, 256, (NUM_BLOCKS * BLOCK_LEN,), dtype=torch.uint8)
        self.dst = torch.zeros_like(self.src)
        self.owner.register_region(self.src)
        self.reader.register_region(self.dst)
        self.owner_meta = self.owner.get_agent_metadata()
        self.peer = self.reader.add_remote_agent(self.owner_meta)
        self.owner.add_remote_agent(self.reader.get_agent_metadata())

    def read(self, notif: bytes = b"done") -> int:
        return self.reader.read(self.peer, DESCS, DESCS, notif)

    def close(self) -> None:
        self.reader.shutdown()
        self.owner.shutdown()


@pytest.fixture(params=["nixl", "ucx"])
def pair(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Pair]:
    p = Pair(request.param, FaultPlan(tmp_path / "plan"), monkeypatch)
    yield p
    p.close()


def until(done: Callable[[], bool], limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def settle(t: Transport, handle: int) -> XferState:
    states: list[XferState] = []
    until(lambda: states.append(t.check_state(handle)) or states[-1] is not XferState.PENDING)
    return states[-1]


def owner_notifs(pair: Pair, count: int) -> list[bytes]:
    got: list[bytes] = []
    until(lambda: got.extend(m for _, m in pair.owner.get_new_notifs()) or len(got) >= count)
    return got


def quiet(t: Transport, checks: int = 20) -> list[tuple[str, bytes]]:
    """What arrives over `checks` polls of a transport that should receive nothing."""
    got = []
    for _ in range(checks):
        got += t.get_new_notifs()
        time.sleep(0.005)
    return got


def test_wrapped_only_with_a_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_KV_FAULT_PLAN", raising=False)
    plain = make_transport("ucx", "plain")
    try:
        assert not isinstance(plain, FaultTransport)
    finally:
        plain.shutdown()
    monkeypatch.setenv("PDSERVE_KV_FAULT_PLAN", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="PDSERVE_KV_FAULT_PLAN names .*missing.json"):
        make_transport("ucx", "no-plan")


def test_bad_rules_name_the_rule(pair: Pair) -> None:
    pair.plan.set(rule("odd", "recv_notif", "fail"))
    with pytest.raises(ValueError, match="fault rule 'odd': action at recv_notif"):
        pair.read()
    pair.plan.set(rule("where", "nowhere", "drop"))
    with pytest.raises(ValueError, match="fault rule 'where': at must be one of"):
        pair.read()


def test_no_rule_passes_through(pair: Pair) -> None:
    handle = pair.read(b"plain")
    assert settle(pair.reader, handle) is XferState.DONE
    pair.reader.release(handle)
    assert torch.equal(pair.dst, pair.src)
    assert owner_notifs(pair, 1) == [b"plain"]


def test_delay_before_read_posts_on_release(pair: Pair) -> None:
    pair.plan.set(rule("hold", "read", "delay"))
    handle = pair.read()
    pair.plan.wait_fired("hold")
    for _ in range(20):
        assert pair.reader.check_state(handle) is XferState.PENDING
    # Nothing was asked of the owner yet.
    assert not pair.dst.any() and quiet(pair.owner) == []
    pair.plan.release("hold")
    assert settle(pair.reader, handle) is XferState.DONE
    assert torch.equal(pair.dst, pair.src) and owner_notifs(pair, 1) == [b"done"]


def test_fail_and_drop_before_read_send_nothing(pair: Pair) -> None:
    pair.plan.set(rule("fail", "read", "fail"), rule("drop", "read", "drop", nth=2))
    assert pair.reader.check_state(pair.read()) is XferState.ERROR
    dropped = pair.read()
    assert pair.reader.check_state(dropped) is XferState.PENDING
    # A lost request: the reader gives up after its transport's timeout.
    assert settle(pair.reader, dropped) is XferState.ERROR
    assert not pair.dst.any() and quiet(pair.owner) == []
    # Both rules are spent: the third read goes through.
    assert settle(pair.reader, pair.read()) is XferState.DONE
    assert (pair.plan.fired("fail"), pair.plan.fired("drop")) == (1, 1)


def test_fail_and_delay_after_transfer(pair: Pair) -> None:
    """The bytes landed and the owner was told, but the reader hears ERROR, or DONE late."""
    pair.plan.set(rule("fail", "transfer", "fail"), rule("late", "transfer", "delay", nth=2))
    assert settle(pair.reader, pair.read(b"one")) is XferState.ERROR
    assert torch.equal(pair.dst, pair.src) and owner_notifs(pair, 1) == [b"one"]
    pair.dst.zero_()
    handle = pair.read(b"two")
    got: list[bytes] = []

    def landed() -> bool:
        # The reader's polls drive NIXL's transfer: they go on while it is held.
        assert pair.reader.check_state(handle) is XferState.PENDING
        got.extend(m for _, m in pair.owner.get_new_notifs())
        return got == [b"two"] and torch.equal(pair.dst, pair.src)

    until(landed)
    pair.plan.release("late")
    assert settle(pair.reader, handle) is XferState.DONE


@pytest.mark.parametrize("at", ["read", "transfer"])
def test_corrupt_flips_every_stride_th_byte(pair: Pair, at: str) -> None:
    pair.plan.set(rule("flip", at, "corrupt", stride=7))
    assert settle(pair.reader, pair.read()) is XferState.DONE
    flipped = torch.zeros_like(pair.src, dtype=torch.bool)
    flipped[::7] = True
    assert torch.equal(pair.dst[flipped], pair.src[flipped] ^ 0xFF)
    assert torch.equal(pair.dst[~flipped], pair.src[~flipped])


@pytest.mark.parametrize("at", ["read", "transfer"])
def test_disconnect_lasts_until_the_peer_is_learnt_again(pair: Pair, at: str) -> None:
    pair.plan.set(rule("cut", at, "disconnect"))
    assert settle(pair.reader, pair.read()) is XferState.ERROR
    # Later reads fail at once and messages are lost, with no rule left to apply.
    assert pair.reader.check_state(pair.read()) is XferState.ERROR
    pair.reader.send_notif(pair.peer, b"lost")
    pair.dst.zero_()
    assert b"lost" not in [m for _, m in quiet(pair.owner)]
    assert pair.reader.add_remote_agent(pair.owner_meta) == pair.peer
    assert settle(pair.reader, pair.read(b"back")) is XferState.DONE
    assert torch.equal(pair.dst, pair.src)


def test_send_notif_faults(pair: Pair) -> None:
    pair.plan.set(
        rule("drop", "send_notif", "drop", contains="a"),
        rule("fail", "send_notif", "fail", contains="b"),
        rule("flip", "send_notif", "corrupt", contains="c"),
        rule("late", "send_notif", "delay", contains="d"),
    )
    pair.reader.send_notif(pair.peer, b"a")
    with pytest.raises(RuntimeError, match="rule fail"):
        pair.reader.send_notif(pair.peer, b"b")
    pair.reader.send_notif(pair.peer, b"c")
    pair.reader.send_notif(pair.peer, b"d")
    pair.reader.send_notif(pair.peer, b"e")
    assert sorted(owner_notifs(pair, 2)) == sorted([bytes([ord("c") ^ 0xFF]), b"e"])
    pair.plan.release("late")
    pair.reader.get_new_notifs()  # any call delivers what was released
    assert owner_notifs(pair, 1) == [b"d"]


def test_recv_notif_faults_on_the_owner(pair: Pair) -> None:
    pair.plan.set(
        rule("drop", "recv_notif", "drop", agent="owner", contains="hb"),
        rule("late", "recv_notif", "delay", agent="owner", contains="done"),
        rule("seen", "recv_notif", "pass", agent="owner", count=0),
    )
    pair.reader.send_notif(pair.peer, b"hb-1")
    assert settle(pair.reader, pair.read(b"done-1")) is XferState.DONE
    pair.reader.send_notif(pair.peer, b"other")
    assert owner_notifs(pair, 1) == [b"other"]
    # Every message the owner received was observed; only the delayed one is still to come.
    pair.plan.wait_fired("seen", 3)
    assert quiet(pair.owner) == []
    pair.plan.release("late")
    assert owner_notifs(pair, 1) == [b"done-1"]


def test_nth_count_and_reload(pair: Pair) -> None:
    pair.plan.set(rule("two", "read", "fail", nth=2, count=2))
    states = [settle(pair.reader, pair.read()) for _ in range(5)]
    assert states == [XferState.DONE, XferState.ERROR, XferState.ERROR, XferState.DONE] + [
        XferState.DONE
    ]
    # A new plan counts afresh.
    pair.plan.set(rule("first", "read", "fail"))
    assert settle(pair.reader, pair.read()) is XferState.ERROR
    pair.plan.set()
    assert settle(pair.reader, pair.read()) is XferState.DONE
