"""The calls an executor has in flight to its worker processes, and the watch for a worker's death.

What the multiprocess and Ray executors share; they differ only in how a call's replies are read
and how a death is noticed, which they pass in. An executor sends a call to every worker and
queues it here in the same order (under its own send lock); one thread resolves the queued
calls' futures in that order. Another thread waits for a worker to die and hands the death to
the executor, which fails itself (`Executor._worker_died`). See docs/executors.md.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

CallT = TypeVar("CallT")


class WorkerCalls(Generic[CallT]):
    def __init__(
        self,
        read_replies: Callable[[CallT], Any],
        wait_for_death: Callable[[], str | None],
        on_death: Callable[[str], None],
    ) -> None:
        """`read_replies(call)`: the call's result, or raises its error. `wait_for_death()`:
        blocks until a worker dies and names it, or returns None when the executor shuts down
        first. `on_death(worker)`: fails the executor."""
        self._read_replies = read_replies
        self._wait_for_death = wait_for_death
        self._on_death = on_death
        self._queue: queue.Queue[tuple[CallT, Future[Any]] | None] = queue.Queue()

    def start(self) -> None:
        """Once the workers are up: one thread resolves replies, one watches the workers."""
        threading.Thread(
            target=self._resolve, daemon=True, name="pdserve-executor-responses"
        ).start()
        threading.Thread(target=self._watch, daemon=True, name="pdserve-worker-monitor").start()

    def add(self, call: CallT) -> Future[Any]:
        """Queue a call just sent; its future resolves after every call queued before it."""
        future: Future[Any] = Future()
        self._queue.put((call, future))
        return future

    def close(self) -> None:
        """The end-of-calls mark: the calls queued before it still resolve (or fail)."""
        self._queue.put(None)

    def _resolve(self) -> None:
        while (item := self._queue.get()) is not None:
            call, future = item
            try:
                result = self._read_replies(call)
            except Exception as e:
                future.set_exception(e)
            else:
                future.set_result(result)

    def _watch(self) -> None:
        dead = self._wait_for_death()
        if dead is not None:
            self._on_death(dead)


def wait_for_reply(future: Future, method: str, timeout: float | None, non_block: bool) -> Any:
    """The future itself when non_block, else its result (a timeout names the method)."""
    if non_block:
        return future
    try:
        return future.result(timeout)
    except TimeoutError:
        raise TimeoutError(f"RPC call to {method} timed out.") from None
