"""A transport that injects faults by a plan, for tests: it wraps a real one (nixl or ucx).

Tests only: `make_transport` wraps every transport of a process in one when
PDSERVE_KV_FAULT_PLAN names a plan file, and says so in a warning. The plan is JSON,
`{"rules": [Rule, ...]}`, re-read whenever the file changes, so one running instance serves
many plans; each rule counts the calls it matches from the moment its plan was read.

Points (`at`) and what each action does there:
- `read`, when a transfer (a READ, or a WRITE: a rule's `op` picks one) is posted, before
  anything moves: `delay` posts it later, `drop`
  never posts it (PENDING for the transport's `timeout_s`, then ERROR, as a lost request looks),
  `fail` ends it ERROR at once, `disconnect` too, and the peer stays disconnected,
  `corrupt` posts it and flips bytes of what arrived (READs only: a WRITE's bytes land in the
  peer's memory, out of this wrapper's reach).
- `transfer`, when a posted transfer completes (the owner got its notif; the bytes are in place):
  `delay` reports DONE later, `drop` PENDING for `timeout_s` then ERROR, `fail` ERROR,
  `disconnect` ERROR and the peer disconnected, `corrupt` flips bytes of what arrived.
- `send_notif`: `delay` sends it later, `drop` never, `fail` raises, `disconnect` drops it and
  disconnects the peer, `corrupt` flips bytes of the message.
- `recv_notif` (each message `get_new_notifs` returns): `delay`, `drop`, `corrupt`.
`pass` changes nothing: with the event it logs, it lets a test observe a call.

A disconnected peer's reads are ERROR at once and messages to it are lost, until
`add_remote_agent` learns it again (a re-handshake). A `delay` with `seconds` ends on its own;
without, it ends when the file `<rule name>.release` appears beside the plan. Every application
of a rule appends `<rule name> <agent name>` to `events.log` beside the plan, which a test waits
for instead of sleeping (tests/utils/faults.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from pdserve.kv_connector.transport.base import Desc, MemoryKind, Transport, XferOp, XferState

logger = logging.getLogger(__name__)

ACTIONS = ("pass", "delay", "drop", "fail", "corrupt", "disconnect")
POINTS = {
    "read": ACTIONS,
    "transfer": ACTIONS,
    "send_notif": ACTIONS,
    "recv_notif": ("pass", "delay", "drop", "corrupt"),
}


class Rule(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    at: str
    action: str
    nth: int = 1  # the first matching call it applies to, counting from 1
    count: int = 1  # how many matching calls from the nth on (0: every one)
    contains: str = ""  # only calls whose notif or message holds these bytes (UTF-8)
    agent: str = ""  # only in transports whose agent name holds this
    peer: str = ""  # only with peers whose agent name holds this
    op: str = ""  # only transfers of this XferOp ("READ" or "WRITE"); "": both
    seconds: float | None = None  # delay: how long; None: until <name>.release exists
    stride: int = 1  # corrupt: flip every stride-th byte

    def __post_init__(self) -> None:
        if self.at not in POINTS:
            raise ValueError(f"fault rule {self.name!r}: at must be one of {sorted(POINTS)}.")
        if self.action not in POINTS[self.at]:
            raise ValueError(
                f"fault rule {self.name!r}: action at {self.at} must be one of "
                f"{', '.join(POINTS[self.at])}, got {self.action!r}."
            )
        if self.op not in ("", "READ", "WRITE"):
            raise ValueError(f"fault rule {self.name!r}: op must be READ, WRITE or empty.")
        if self.op == "WRITE" and self.action == "corrupt":
            raise ValueError(f"fault rule {self.name!r}: corrupt applies to READs only.")
        if self.nth < 1 or self.count < 0 or self.stride < 1:
            raise ValueError(f"fault rule {self.name!r}: nth and stride >= 1, count >= 0.")


class Plan(msgspec.Struct, forbid_unknown_fields=True):
    rules: list[Rule] = msgspec.field(default_factory=list)


@dataclass
class _Xfer:
    op: XferOp
    peer: str
    local: list[Desc]
    remote: list[Desc]
    notif: bytes
    started: float
    before: Rule | None  # the rule applied at `read`
    after: Rule | None  # the rule applied at `transfer` (or `read`'s corrupt)
    inner: int | None = None  # the real transfer, once posted
    landed: float | None = None  # when the real transfer completed
    state: XferState = XferState.PENDING


@dataclass
class _Held:
    rule: Rule
    since: float
    deliver: Callable[[], None]


@dataclass
class _Rules:
    plan: Plan = field(default_factory=Plan)
    seen: list[int] = field(default_factory=list)
    stamp: tuple[int, int, int] | None = None


class FaultTransport(Transport):
    """`inner` with the faults of the plan at `plan_path`."""

    def __init__(self, inner: Transport, plan_path: Path) -> None:
        if not plan_path.is_file():
            raise ValueError(f"PDSERVE_KV_FAULT_PLAN names {plan_path}, which is not a file.")
        self.inner = inner
        self.name = inner.name
        self.agent_name = inner.agent_name
        self.timeout_s = inner.timeout_s
        self.no_device_reason = inner.no_device_reason
        self.plan_path = plan_path
        self._lock = threading.RLock()
        self._rules = _Rules()
        self._regions: list[torch.Tensor] = []  # uint8 views, for corrupt
        self._xfers: dict[int, _Xfer] = {}
        self._next_handle = 0
        self._disconnected: set[str] = set()
        self._held: list[_Held] = []
        self._received: list[tuple[str, bytes]] = []
        logger.warning(
            "KV transport %s: fault injection is ON (PDSERVE_KV_FAULT_PLAN=%s); for tests only.",
            self.agent_name,
            plan_path,
        )

    # ---- the plan ---------------------------------------------------------------------------

    def _load(self) -> None:
        try:
            st = os.stat(self.plan_path)
        except FileNotFoundError:
            self._rules = _Rules()
            return
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._rules.stamp:
            return
        try:
            plan = msgspec.json.decode(self.plan_path.read_bytes() or b"{}", type=Plan)
        except msgspec.DecodeError as e:
            raise ValueError(f"PDSERVE_KV_FAULT_PLAN {self.plan_path}: {e}") from None
        self._rules = _Rules(plan, [0] * len(plan.rules), stamp)

    def _match(self, at: str, peer: str, data: bytes, op: XferOp | None = None) -> list[Rule]:
        """Rules applying to this call, in plan order; every matching rule counts it."""
        self._load()
        applied = []
        needle_ok = {r.contains: r.contains.encode() in data for r in self._rules.plan.rules}
        for i, rule in enumerate(self._rules.plan.rules):
            if (
                rule.at != at
                or rule.agent not in self.agent_name
                or rule.peer not in peer
                or not needle_ok[rule.contains]
                or (rule.op and (op is None or rule.op != op.value))
            ):
                continue
            self._rules.seen[i] += 1
            seen = self._rules.seen[i]
            if seen >= rule.nth and (rule.count == 0 or seen < rule.nth + rule.count):
                self._event(rule, peer)
                applied.append(rule)
        return applied

    def _event(self, rule: Rule, peer: str) -> None:
        logger.warning(
            "Fault plan: rule %s, %s at %s (agent %s, peer %s).",
            rule.name,
            rule.action,
            rule.at,
            self.agent_name,
            peer,
        )
        with open(self.plan_path.parent / "events.log", "a") as f:
            f.write(f"{rule.name} {self.agent_name}\n")

    def _released(self, rule: Rule, since: float) -> bool:
        if rule.seconds is not None:
            return time.monotonic() - since >= rule.seconds
        return (self.plan_path.parent / f"{rule.name}.release").exists()

    @staticmethod
    def _fault(rules: list[Rule]) -> Rule | None:
        return next((r for r in rules if r.action != "pass"), None)

    def _flush_held(self) -> None:
        for held in [h for h in self._held if self._released(h.rule, h.since)]:
            self._held.remove(held)
            held.deliver()

    # ---- set-up: delegated ------------------------------------------------------------------

    def reaches(self, kind: MemoryKind) -> bool:
        return self.inner.reaches(kind)

    def read_obstacle(self, remote: MemoryKind) -> str | None:
        return self.inner.read_obstacle(remote)

    def register_region(self, tensor: torch.Tensor) -> int:
        region = self.inner.register_region(tensor)
        self._regions.append(tensor.detach().reshape(-1).view(torch.uint8))
        return region

    def get_agent_metadata(self) -> bytes:
        return self.inner.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        name = self.inner.add_remote_agent(metadata)
        with self._lock:
            self._disconnected.discard(name)
        return name

    def remove_remote_agent(self, agent_name: str) -> None:
        self.inner.remove_remote_agent(agent_name)

    # ---- transfers --------------------------------------------------------------------------

    def post(
        self, op: XferOp, remote_agent: str, local: list[Desc], remote: list[Desc], notif: bytes
    ) -> int:
        with self._lock:
            self._flush_held()
            before = self._fault(self._match("read", remote_agent, notif, op))
            after = self._fault(self._match("transfer", remote_agent, notif, op))
            if before is not None and before.action == "corrupt":
                before, after = None, before
            xfer = _Xfer(op, remote_agent, local, remote, notif, time.monotonic(), before, after)
            self._next_handle += 1
            self._xfers[self._next_handle] = xfer
            if remote_agent in self._disconnected:
                xfer.state = XferState.ERROR
            elif before is None:
                xfer.inner = self.inner.post(op, remote_agent, local, remote, notif)
            elif before.action == "disconnect":
                self._disconnected.add(remote_agent)
                xfer.state = XferState.ERROR
            elif before.action == "fail":
                xfer.state = XferState.ERROR
            return self._next_handle

    def check_state(self, handle: int) -> XferState:
        with self._lock:
            self._flush_held()
            xfer = self._xfers.get(handle)
            if xfer is None:
                raise ValueError(f"unknown transfer handle {handle}.")
            if xfer.state is XferState.PENDING:
                xfer.state = self._advance(xfer)
            return xfer.state

    def _advance(self, xfer: _Xfer) -> XferState:
        now = time.monotonic()
        if xfer.peer in self._disconnected and xfer.inner is None:
            return XferState.ERROR
        if xfer.inner is None:
            assert xfer.before is not None
            if xfer.before.action == "drop":
                return XferState.ERROR if now - xfer.started > self.timeout_s else XferState.PENDING
            if not self._released(xfer.before, xfer.started):
                return XferState.PENDING
            try:
                xfer.inner = self.inner.post(
                    xfer.op, xfer.peer, xfer.local, xfer.remote, xfer.notif
                )
            except Exception as e:  # the descriptors or the peer went bad while it was held
                logger.warning("Fault plan: a held %s failed to start: %s", xfer.op.value, e)
                return XferState.ERROR
        if xfer.landed is None:
            state = self.inner.check_state(xfer.inner)
            if state is not XferState.DONE:
                return state
            xfer.landed = now
            if xfer.peer in self._disconnected:
                return XferState.ERROR
            if xfer.after is not None and xfer.after.action == "corrupt" and xfer.op is XferOp.READ:
                self._corrupt(xfer.local, xfer.after.stride)
        after = xfer.after
        if after is None or after.action in ("pass", "corrupt"):
            return XferState.DONE
        if after.action == "delay":
            return XferState.DONE if self._released(after, xfer.landed) else XferState.PENDING
        if after.action == "drop":
            return XferState.ERROR if now - xfer.landed > self.timeout_s else XferState.PENDING
        if after.action == "disconnect":
            self._disconnected.add(xfer.peer)
        return XferState.ERROR

    def _corrupt(self, descs: list[Desc], stride: int) -> None:
        for d in descs:
            span = self._regions[d.region][d.offset : d.offset + d.length]
            span[::stride] ^= 0xFF

    def release(self, handle: int) -> None:
        with self._lock:
            xfer = self._xfers.pop(handle, None)
        if xfer is not None and xfer.inner is not None:
            self.inner.release(xfer.inner)

    # ---- notifications ----------------------------------------------------------------------

    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        with self._lock:
            self._flush_held()
            rule = self._fault(self._match("send_notif", remote_agent, msg))
            if remote_agent in self._disconnected:
                logger.warning("Fault plan: a message to disconnected %s is lost.", remote_agent)
                return
            if rule is None:
                self.inner.send_notif(remote_agent, msg)
            elif rule.action == "fail":
                raise RuntimeError(f"fault plan: rule {rule.name} fails this notification.")
            elif rule.action == "disconnect":
                self._disconnected.add(remote_agent)
            elif rule.action == "corrupt":
                self.inner.send_notif(remote_agent, _flipped(msg, rule.stride))
            elif rule.action == "delay":
                self._held.append(
                    _Held(rule, time.monotonic(), lambda: self._send_late(remote_agent, msg))
                )

    def _send_late(self, remote_agent: str, msg: bytes) -> None:
        if remote_agent not in self._disconnected:
            self.inner.send_notif(remote_agent, msg)

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._flush_held()
            for sender, msg in self.inner.get_new_notifs():
                rule = self._fault(self._match("recv_notif", sender, msg))
                if rule is None:
                    self._received.append((sender, msg))
                elif rule.action == "corrupt":
                    self._received.append((sender, _flipped(msg, rule.stride)))
                elif rule.action == "delay":
                    item = (sender, msg)
                    self._held.append(
                        _Held(rule, time.monotonic(), lambda item=item: self._received.append(item))
                    )
            received, self._received = self._received, []
            return received

    def shutdown(self) -> None:
        self.inner.shutdown()


def _flipped(msg: bytes, stride: int) -> bytes:
    out = bytearray(msg)
    for i in range(0, len(out), stride):
        out[i] ^= 0xFF
    return bytes(out)
