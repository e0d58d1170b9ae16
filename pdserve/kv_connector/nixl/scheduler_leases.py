"""The scheduler half's leases (docs/lease.md): the prefill side's lease board slots, and the
decode side's heartbeats, which keep a prefill instance's lease on a request's blocks alive
from the request's arrival here (queued or not) until its read ends."""

from __future__ import annotations

import secrets
import time
from collections import deque

from pdserve.kv_connector.nixl.metadata import (
    LeaseStamp,
    NixlConnectorMetadata,
    RecvReqMeta,
    RemoteAddress,
)
from pdserve.kv_transfer_params import RemoteLease


class LeaseBoard:
    """Prefill side: the slots of the workers' lease board, by request.

    A request that will be read gets a slot and a random tag at admission, before its params can
    leave this instance; the workers write the tag into the slot, and clear it when the lease
    ends (read, or expired) before they report the blocks free. A reader checks the slot after
    its READ: the tag proves the blocks were still this request's while it read. Without the
    workers' board size (no handshake metadata yet) slots are not bounded."""

    def __init__(self) -> None:
        self.num_slots: int | None = None
        self._free: deque[int] = deque()
        self._next = 0
        self.held: dict[str, LeaseStamp] = {}
        self.orders: dict[str, LeaseStamp] = {}  # for the next step's metadata

    def size(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = deque(range(num_slots))

    def has_room(self) -> bool:
        return self.num_slots is None or bool(self._free)

    def take(self, req_id: str) -> None:
        if self.num_slots is None:
            slot, self._next = self._next, self._next + 1
        else:
            slot = self._free.popleft()
        self.held[req_id] = self.orders[req_id] = LeaseStamp(slot, secrets.randbits(62) + 1)

    def clear(self, req_id: str) -> None:
        """The request will not be read: the workers clear its slot, which is free again (the
        clear comes before any later stamp of the slot: the workers apply orders in order)."""
        stamp = self.held.pop(req_id, None)
        if stamp is not None:
            self.orders[req_id] = LeaseStamp(stamp.slot, 0)
            self._release(stamp.slot)

    def ended(self, req_ids: set[str]) -> None:
        """Leases the workers ended (they cleared the slots themselves)."""
        for req_id in req_ids:
            stamp = self.held.pop(req_id, None)
            if stamp is not None:
                self._release(stamp.slot)

    def _release(self, slot: int) -> None:
        if self.num_slots is not None:
            self._free.append(slot)

    def take_orders(self) -> dict[str, LeaseStamp]:
        orders, self.orders = self.orders, {}
        return orders


class Heartbeats:
    """Decode side: request id -> (engine id, remote request id) of every request whose KV a
    prefill instance holds for it, and how often each engine wants to hear of them."""

    def __init__(self, lease_duration: float) -> None:
        self.lease_duration = lease_duration
        self.awaited: dict[str, tuple[str, str]] = {}
        self._addresses: dict[str, RemoteAddress] = {}  # engine id -> its side channel
        # Engine id -> seconds between its heartbeats (a sixth of its lease, which its params
        # say; this instance's own otherwise), and when it last got one.
        self._every: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def watch(self, req_id: str, read: RecvReqMeta, lease: RemoteLease | None) -> None:
        engine_id = read.remote_engine_id
        self.awaited[req_id] = (engine_id, read.remote_request_id)
        self._addresses[engine_id] = RemoteAddress(
            read.remote_host, read.remote_port, read.remote_tp_size
        )
        every = ((lease.seconds if lease else None) or self.lease_duration) / 6
        self._every[engine_id] = min(self._every.get(engine_id, every), every)

    def end(self, req_id: str) -> None:
        self.awaited.pop(req_id, None)

    def due(self, meta: NixlConnectorMetadata) -> None:
        """The step's heartbeats: every engine due one hears of all its requests."""
        now = time.monotonic()
        for engine_id, remote_id in self.awaited.values():
            if engine_id in meta.heartbeats or (
                now - self._last.get(engine_id, -1e18) >= self._every[engine_id]
            ):
                meta.heartbeats.setdefault(engine_id, []).append(remote_id)
        for engine_id in meta.heartbeats:
            self._last[engine_id] = now
        meta.remote_engines = {e: self._addresses[e] for e in meta.heartbeats}
