"""WorkerCalls without workers: futures resolve in the order the calls were queued, a failed read
fails only its call, and a death is handed on unless the executor shut down first."""

from __future__ import annotations

import threading

import pytest

from pdserve.executor.worker_calls import WorkerCalls, wait_for_reply


def test_calls_resolve_in_order_and_fail_alone():
    read: list[int] = []

    def read_replies(call: int) -> int:
        read.append(call)
        if call == 1:
            raise RuntimeError("rank 0 failed")
        return call * 10

    never = threading.Event()
    calls: WorkerCalls[int] = WorkerCalls(read_replies, lambda: never.wait() and None, print)
    futures = [calls.add(i) for i in range(3)]
    calls.start()
    assert futures[2].result(5) == 20
    assert futures[0].result(0) == 0
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        futures[1].result(0)
    assert read == [0, 1, 2]
    calls.close()
    never.set()


def test_a_death_is_handed_on():
    handed: list[str] = []
    called = threading.Event()

    def on_death(worker: str) -> None:
        handed.append(worker)
        called.set()

    WorkerCalls(lambda call: call, lambda: "rank 1 (pid 7)", on_death).start()
    assert called.wait(5)
    assert handed == ["rank 1 (pid 7)"]


def test_no_death_is_handed_on_after_shutdown():
    handed: list[str] = []
    returned = threading.Event()

    def wait_for_death() -> None:
        returned.set()  # the executor was shutting down

    WorkerCalls(lambda call: call, wait_for_death, handed.append).start()
    assert returned.wait(5)
    threading.Event().wait(0.2)  # time enough to call on_death, had it been going to
    assert handed == []


def test_wait_for_reply_names_the_method_on_timeout():
    calls: WorkerCalls[int] = WorkerCalls(lambda call: call, lambda: None, print)
    future = calls.add(0)  # not started: never resolves
    assert wait_for_reply(future, "check_health", None, non_block=True) is future
    with pytest.raises(TimeoutError, match="RPC call to check_health timed out"):
        wait_for_reply(future, "check_health", 0.01, non_block=False)
