"""KV cache events in vLLM's wire format, and the ZMQ publisher that sends them.

An instance tells cache-aware routers which blocks it holds: each engine step's block-stored,
block-removed and all-blocks-cleared events go out as one `KVEventBatch`, msgpack-encoded,
on a ZMQ PUB socket as three frames (topic, 8-byte big-endian sequence number, payload). A
subscriber that sees a gap in the sequence asks the replay socket (ROUTER) for the batches
from a sequence number on: each comes back as (sequence, payload), then (-1, b"") ends the
reply. The structs are vLLM's, field for field: a batch is a positional array
`[ts, events, data_parallel_rank]`, an event a map tagged by its "type"
(`{"type": "BlockStored", "block_hashes": [...], ...}`), which current vLLM sends and
vllm-router 0.1.17 requires (it refuses the older positional events). docs/kv_events.md has
the layout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

if TYPE_CHECKING:
    from pdserve.config.kv_events import KVEventsConfig


logger = logging.getLogger(__name__)

# vLLM's name for the engine's own cache tier (as opposed to an offload tier such as "CPU"),
# whatever device it lives on.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    """Full blocks that joined the prefix cache: one chain, `parent_block_hash` before it."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(block_hash: bytes) -> int:
    """A block hash as events carry it: its last 8 bytes as an unsigned int (vLLM's default,
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), which every router stores as a u64."""
    return int.from_bytes(block_hash[-8:], "big")


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class NullEventPublisher:
    """Events off: batches go nowhere, and nothing runs."""

    publishes = False

    def publish(self, batch: KVEventBatch) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher:
    """Sends batches from its own thread, so that encoding them stays off the engine loop, and
    answers replay requests from the last `buffer_steps` batches.

    A batch that finds the queue full is dropped, but its sequence number is spent: subscribers
    see the gap and replay or resynchronise, instead of silently holding a wrong cache map.
    """

    publishes = True

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(
            config.max_queue_size
        )
        self._seq = count()
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self.dropped = 0
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(
                f"kv_events_config: cannot open {config.endpoint!r} / "
                f"{config.replay_endpoint!r}: {e}"
            ) from None
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "Publishing KV cache events on %s (replay: %s, topic %r)",
            config.endpoint,
            config.replay_endpoint,
            config.topic,
        )

    def publish(self, batch: KVEventBatch) -> None:
        seq = next(self._seq)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, ...: said, not flooded
                logger.warning(
                    "KV event queue full (%d batches): batch %d dropped, %d so far",
                    self.config.max_queue_size,
                    seq,
                    self.dropped,
                )

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                break
            seq, batch = item
            seq_bytes = seq.to_bytes(8, "big")
            payload = encode(batch)
            self._pub.send_multipart((self.topic, seq_bytes, payload))
            self._buffer.append((seq_bytes, payload))
        self._close_sockets()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("Ignoring a KV event replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq_bytes, payload in self._buffer:
            if int.from_bytes(seq_bytes, "big") >= start_seq:
                self._replay.send_multipart((client, b"", seq_bytes, payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def shutdown(self) -> None:
        """Send what is queued, then close."""
        self._queue.put(None)
        self._thread.join(timeout=5)


def make_event_publisher(config: KVEventsConfig | None) -> NullEventPublisher | ZmqEventPublisher:
    if config is None or not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(config)


def new_batch(events: list[Any]) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=events)
