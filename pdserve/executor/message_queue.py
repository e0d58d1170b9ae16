"""A one-writer, many-reader message queue over a shared-memory ring buffer.

The engine broadcasts each step's `SchedulerOutput` to every worker through one of these, and each
worker answers on its own (one reader). Messages that do not fit a chunk go over a ZMQ PUB socket
(the chunk then only says "overflow"); readers on other nodes get everything over TCP.

Waiting: a reader that just received something spins on the chunk flag for a short while (the
next step usually follows within microseconds), then blocks on a ZMQ notification socket, so an
idle instance uses no CPU. A ZMQ send wakes two I/O threads, so the writer notifies only readers
that said they may sleep: a reader raises its `sleeping` flag, spins a little longer (long enough
for the writer to see the flag, whatever the memory ordering), and only then blocks. A reader
re-checks the chunk flag after each wake-up, so an early notification costs nothing.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import msgspec
import zmq

from pdserve.executor.zmq_utils import bind_socket, make_ipc_address

_HEADER = struct.Struct("<q")  # payload length; -1 = the payload went over the overflow socket
_OVERFLOW = -1
_SPIN_SECONDS = 0.05
# Spinning after raising the sleeping flag: a store reaches other cores in well under this.
_ANNOUNCE_SECONDS = 0.005
_POLL_MS = 1000  # only a safety net: readers are woken by the notify socket


class MessageQueueHandle(msgspec.Struct, array_like=True):
    """What a reader needs to attach: sent from the writer's process to the readers'."""

    shm_name: str | None
    num_chunks: int
    chunk_bytes: int
    num_local_readers: int
    notify_addr: str
    overflow_addr: str
    remote_addr: str | None


class MessageQueue:
    """Create with `MessageQueue(...)` (writer) or `MessageQueue.attach(handle, rank)` (reader)."""

    def __init__(
        self,
        num_local_readers: int,
        num_remote_readers: int = 0,
        chunk_bytes: int = 1 << 20,
        num_chunks: int = 8,
        remote_host: str = "127.0.0.1",
    ) -> None:
        self.ctx = zmq.Context()
        self.is_writer = True
        self.num_chunks, self.chunk_bytes = num_chunks, chunk_bytes
        self.num_local_readers = num_local_readers
        self.meta_bytes = 1 + num_local_readers  # [written, read_by_0, ..., read_by_n-1]
        self.slot_bytes = self.meta_bytes + _HEADER.size + chunk_bytes
        self.shm: shared_memory.SharedMemory | None = None
        if num_local_readers:
            # [sleeping_0, ..., sleeping_n-1], then the chunks.
            size = num_local_readers + self.slot_bytes * num_chunks
            self.shm = shared_memory.SharedMemory(create=True, size=size)
            self.shm.buf[:] = bytes(len(self.shm.buf))
        # XPUB rather than PUB: it reports each subscription, so wait_until_ready() can hold the
        # first message until every reader is connected (PUB drops what precedes a subscriber).
        self.notify = _publisher(self.ctx)
        notify_addr = bind_socket(self.notify, make_ipc_address("mq-notify"))
        self.overflow = _publisher(self.ctx)
        overflow_addr = bind_socket(self.overflow, make_ipc_address("mq-overflow"))
        self.remote: zmq.Socket | None = None
        self.num_remote_readers = num_remote_readers
        remote_addr = None
        if num_remote_readers:
            self.remote = _publisher(self.ctx)
            remote_addr = bind_socket(self.remote, f"tcp://{remote_host}:*")
        self.handle = MessageQueueHandle(
            self.shm.name if self.shm else None,
            num_chunks,
            chunk_bytes,
            num_local_readers,
            notify_addr,
            overflow_addr,
            remote_addr,
        )
        self.index = 0

    @classmethod
    def attach(cls, handle: MessageQueueHandle, reader_rank: int | None) -> MessageQueue:
        """A reader: `reader_rank` is its local index, or None for a reader on another node."""
        self = cls.__new__(cls)
        self.ctx = zmq.Context()
        self.is_writer = False
        self.handle = handle
        self.num_chunks, self.chunk_bytes = handle.num_chunks, handle.chunk_bytes
        self.num_local_readers = handle.num_local_readers
        self.meta_bytes = 1 + handle.num_local_readers
        self.slot_bytes = self.meta_bytes + _HEADER.size + handle.chunk_bytes
        self.reader_rank = reader_rank
        self.index = 0
        self.shm = None
        self.remote = None
        if reader_rank is None:
            assert handle.remote_addr is not None, "the writer has no remote readers"
            self.remote = _subscriber(self.ctx, handle.remote_addr)
        else:
            # Attaching registers the segment with the resource tracker too; spawned workers
            # share their parent's tracker, so that is the same entry, and the writer's unlink
            # clears it.
            self.shm = shared_memory.SharedMemory(name=handle.shm_name)
            self.notify = _subscriber(self.ctx, handle.notify_addr)
            self.overflow = _subscriber(self.ctx, handle.overflow_addr)
        return self

    # ---- writer ----------------------------------------------------------------------------

    def wait_until_ready(self, timeout: float = 60.0) -> None:
        """Block until every reader has subscribed to the sockets it reads."""
        deadline = time.monotonic() + timeout
        expected = [(self.notify, self.num_local_readers), (self.overflow, self.num_local_readers)]
        if self.remote is not None:
            expected.append((self.remote, self.num_remote_readers))
        for sock, count in expected:
            while count > 0:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not sock.poll(remaining_ms):
                    raise TimeoutError("Message queue readers did not connect in time.")
                if sock.recv()[:1] == b"\x01":  # a subscription (0x00 would be a leave)
                    count -= 1

    def enqueue(self, payload: bytes) -> None:
        assert self.is_writer
        if self.remote is not None:
            self.remote.send(payload, copy=False)
        if self.shm is None:
            return
        buf, base = self.shm.buf, self._chunk_offset()
        # The chunk is free once every reader has read it (or it was never written).
        self._wait(lambda: buf[base] == 0 or all(buf[base + 1 : base + self.meta_bytes]))
        start = base + self.meta_bytes
        if len(payload) <= self.chunk_bytes:
            _HEADER.pack_into(buf, start, len(payload))
            body = start + _HEADER.size
            buf[body : body + len(payload)] = payload
        else:
            _HEADER.pack_into(buf, start, _OVERFLOW)
            self.overflow.send(payload, copy=False)
        buf[base + 1 : base + self.meta_bytes] = bytes(self.num_local_readers)
        buf[base] = 1  # published last: a reader that sees it sees the payload
        if any(buf[: self.num_local_readers]):
            self.notify.send(b"")
        self.index = (self.index + 1) % self.num_chunks

    # ---- reader ----------------------------------------------------------------------------

    def dequeue(self, timeout: float | None = None) -> bytes:
        """The next message; raises TimeoutError after `timeout` seconds without one."""
        assert not self.is_writer
        if self.remote is not None:
            if not self.remote.poll(None if timeout is None else int(timeout * 1000)):
                raise TimeoutError("No message within the timeout.")
            return self.remote.recv()
        buf, base = self.shm.buf, self._chunk_offset()
        flag = base + 1 + self.reader_rank
        self._wait(lambda: buf[base] == 1 and buf[flag] == 0, timeout)
        start = base + self.meta_bytes
        (length,) = _HEADER.unpack_from(buf, start)
        if length == _OVERFLOW:
            payload = self.overflow.recv()
        else:
            body = start + _HEADER.size
            payload = bytes(buf[body : body + length])
        buf[flag] = 1
        self.index = (self.index + 1) % self.num_chunks
        return payload

    def _chunk_offset(self) -> int:
        return self.num_local_readers + self.index * self.slot_bytes

    def _wait(self, ready: Callable[[], bool], timeout: float | None = None) -> None:
        """Spin briefly, then sleep on the notification socket until `ready()` holds."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        sleeping = False
        try:
            while not ready():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError("No message within the timeout.")
                if self.is_writer:
                    if now - start >= _SPIN_SECONDS:
                        time.sleep(0.0005)  # readers are behind: rare, and never while idle
                        continue
                elif now - start >= _SPIN_SECONDS and not sleeping:
                    sleeping = True
                    self.shm.buf[self.reader_rank] = 1  # from now on the writer notifies
                elif now - start >= _SPIN_SECONDS + _ANNOUNCE_SECONDS:
                    wait_ms = (
                        _POLL_MS
                        if deadline is None
                        else max(1, min(_POLL_MS, int((deadline - now) * 1000)))
                    )
                    if self.notify.poll(wait_ms):
                        while self.notify.poll(0):
                            self.notify.recv()
                    continue
                # Yield while spinning: on a machine with fewer cores than processes, a
                # spinning reader must not take the core its writer needs.
                os.sched_yield()
        finally:
            if sleeping:
                self.shm.buf[self.reader_rank] = 0

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            if self.is_writer:
                self.shm.unlink()
            self.shm = None
        self.ctx.destroy(linger=0)


def _publisher(ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not only the first
    return sock


def _subscriber(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(addr)
    return sock
