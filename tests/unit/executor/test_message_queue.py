"""The shared-memory message queue: order, overflow, and who gets woken."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from pdserve.executor import message_queue
from pdserve.executor.message_queue import MessageQueue


@pytest.fixture
def queues() -> Iterator[tuple[MessageQueue, list[MessageQueue]]]:
    writer = MessageQueue(num_local_readers=2, chunk_bytes=64, num_chunks=2)
    readers = [MessageQueue.attach(writer.handle, rank) for rank in range(2)]
    writer.wait_until_ready(10.0)
    yield writer, readers
    for mq in readers + [writer]:
        mq.close()


def test_every_reader_gets_every_message_in_order(queues) -> None:
    writer, readers = queues
    messages = [b"a", b"b" * 100, b"", b"c"]  # the second goes over the overflow socket
    got: list[list[bytes]] = [[], []]

    def read(rank: int) -> None:
        got[rank] = [readers[rank].dequeue(timeout=10.0) for _ in messages]

    threads = [threading.Thread(target=read, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for m in messages:  # more messages than chunks: the writer waits for both readers
        writer.enqueue(m)
    for t in threads:
        t.join(10.0)
    assert got == [messages, messages]


def test_writer_notifies_only_readers_that_may_sleep(queues, monkeypatch) -> None:
    writer, readers = queues
    sent: list[bytes] = []
    real_notify = writer.notify
    monkeypatch.setattr(writer, "notify", _Recorder(real_notify, sent))
    writer.enqueue(b"x")  # both readers awake (none has waited yet)
    assert [r.dequeue(timeout=1.0) for r in readers] == [b"x", b"x"]
    assert sent == []

    # A reader past its spin announces that it may sleep; the writer then wakes it.
    monkeypatch.setattr(message_queue, "_SPIN_SECONDS", 0.0)
    box: list[bytes] = []
    reader = threading.Thread(target=lambda: box.append(readers[0].dequeue(timeout=30.0)))
    reader.start()
    for _ in range(10_000):
        if writer.shm.buf[0]:
            break
        reader.join(0.001)
    assert writer.shm.buf[0], "the reader never said it may sleep"
    writer.enqueue(b"y")
    reader.join(30.0)
    assert box == [b"y"] and sent == [b""]
    assert writer.shm.buf[0] == 0  # back to spinning after the message
    assert readers[1].dequeue(timeout=1.0) == b"y"


class _Recorder:
    def __init__(self, sock, sent: list[bytes]) -> None:
        self._sock, self._sent = sock, sent

    def send(self, data: bytes) -> None:
        self._sent.append(data)
        self._sock.send(data)
