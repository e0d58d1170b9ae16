"""The other end of the KV event stream: a subscriber that keeps an instance's cached blocks.

It reads batches in sequence order; on a gap (it joined late, or the PUB socket dropped batches
at its high-water mark) it asks the replay socket for the missing ones. Batches the publisher no
longer holds are lost for good: the map is then only as good as the events that follow, which
is what a cache-aware router can live with (a wrong guess costs a cache miss, never a wrong
answer).
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from pdserve.distributed.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

logger = logging.getLogger(__name__)

_REPLAY_TIMEOUT_MS = 2000


class CachedBlocks:
    """The block hashes (as events carry them) an instance holds in its prefix cache."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.hashes.clear()


class KVEventSubscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        # The next sequence number expected; None until the first batch.
        self.next_seq: int | None = None
        # The last sequence number heard on the live socket (replays do not count).
        self._last_live: int | None = None
        self.lost = 0

    def replay_from(self, start_seq: int) -> list[KVEventBatch]:
        """The publisher's batches from `start_seq` on, as many as it still holds."""
        if self._replay is None:
            return []
        self._replay.send_multipart((b"", start_seq.to_bytes(8, "big")))
        if self.next_seq is None:
            self.next_seq = start_seq
        batches = []
        while self._replay.poll(_REPLAY_TIMEOUT_MS):
            _, seq_bytes, payload = self._replay.recv_multipart()
            if seq_bytes == END_SEQ:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:
                continue
            self._count_gap(seq)
            batches.append(self._decode(payload))
            self.next_seq = seq + 1
        return batches

    def _count_gap(self, seq: int) -> None:
        if self.next_seq is not None and seq > self.next_seq:
            self.lost += seq - self.next_seq
            logger.warning("KV events %d-%d are lost", self.next_seq, seq - 1)

    def poll(self, timeout_ms: int) -> list[KVEventBatch]:
        """The batches that arrived within `timeout_ms` (and any replayed to fill a gap)."""
        batches: list[KVEventBatch] = []
        wait = timeout_ms
        while self._sub.poll(wait):
            wait = 0
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self._last_live is not None and seq <= self._last_live:
                # Live sequence numbers only grow within one publisher: this one restarted,
                # with an empty cache. Everything held before is gone.
                logger.info("KV event publisher restarted: its cache map starts over")
                batches.append(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
                self.next_seq = None
            self._last_live = seq
            expected = 0 if self.next_seq is None else self.next_seq
            if seq < expected:
                continue  # already had it from a replay
            if seq > expected:
                batches += self.replay_from(expected)
                if self.next_seq is not None and seq < self.next_seq:
                    continue
            self._count_gap(seq)
            batches.append(self._decode(payload))
            self.next_seq = seq + 1
        return batches

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
