"""The prefill worker's leases (docs/lease.md): the blocks of each finished request stay held
until every reader said `done`, or until the lease, which heartbeats extend, expires unread.

The board is a tensor peers READ: slot -> the tag of the lease that holds it, 0 once it
ended. A reader checks its slot after its data READ: the tag proves the blocks were still this
request's when every byte had left them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.kv_connector.nixl.metadata import LeaseStamp, Notif

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    expiry: float
    reads_seen: int = 0
    readers_needed: int = 1


class LeaseHolder:
    def __init__(self, lease_duration: float) -> None:
        self.lease_duration = lease_duration
        self.board: torch.Tensor | None = None
        self._slots: dict[str, int] = {}  # request id -> its slot on the board
        self._leases: dict[str, _Lease] = {}
        # Done notifications that beat their lease: request id -> (count, when), and readers.
        self._early_reads: dict[str, tuple[int, float]] = {}
        self._readers_needed: dict[str, int] = {}
        self._ended: set[str] = set()

    def make_board(self, num_slots: int) -> torch.Tensor:
        self.board = torch.zeros(num_slots, dtype=torch.int64)
        return self.board

    def stamp(self, stamps: dict[str, LeaseStamp]) -> None:
        """The scheduler's board orders: a tag written in a slot, or a slot cleared (tag 0)."""
        for req_id, stamp in stamps.items():
            assert self.board is not None
            self.board[stamp.slot] = stamp.tag
            if stamp.tag:
                self._slots[req_id] = stamp.slot
            else:
                self._slots.pop(req_id, None)

    def hold(self, reqs_to_send: dict[str, float]) -> None:
        """Leases of newly finished requests (request id -> expiry, wall clock)."""
        for req_id, expiry in reqs_to_send.items():
            lease = self._leases[req_id] = _Lease(expiry)
            if req_id in self._early_reads:
                lease.reads_seen = self._early_reads.pop(req_id)[0]
                lease.readers_needed = self._readers_needed.pop(req_id)
                self._settle(req_id, lease)

    def notify(self, notif: Notif) -> None:
        """A reader's heartbeat (extends its leases) or `done` (one read of each request)."""
        for req_id in notif.request_ids:
            lease = self._leases.get(req_id)
            if notif.kind == "heartbeat":
                if lease is not None:
                    lease.expiry = max(lease.expiry, time.time() + self.lease_duration * 2 / 3)
            elif lease is None:
                # Read before this worker saw the lease (it comes with the next step).
                count, _ = self._early_reads.get(req_id, (0, 0.0))
                self._early_reads[req_id] = (count + 1, time.time())
                self._readers_needed[req_id] = notif.num_readers
            else:
                lease.reads_seen += 1
                lease.readers_needed = notif.num_readers
                self._settle(req_id, lease)

    def take_ended(self) -> tuple[set[str], int]:
        """Requests whose blocks go back to the scheduler (read by all, or expired unread),
        and how many of them expired."""
        now = time.time()
        expired = [r for r, lease in self._leases.items() if lease.expiry < now]
        for req_id in expired:
            del self._leases[req_id]
            logger.warning(
                "Releasing the KV blocks of request %s: its lease expired unread.", req_id
            )
            self._end(req_id)
        for req_id in [
            r for r, (_, seen) in self._early_reads.items() if seen < now - self.lease_duration
        ]:
            # Its lease never came (aborted here before it finished): forget it.
            del self._early_reads[req_id]
            self._readers_needed.pop(req_id, None)
        ended, self._ended = self._ended, set()
        return ended, len(expired)

    def _settle(self, req_id: str, lease: _Lease) -> None:
        if lease.reads_seen >= lease.readers_needed:
            del self._leases[req_id]
            self._end(req_id)

    def _end(self, req_id: str) -> None:
        """A reader checking the slot from now on fails."""
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            assert self.board is not None
            self.board[slot] = 0
        self._ended.add(req_id)
