"""MultiprocExecutor: one spawned worker process per rank, driven over shared-memory queues.

Each call is broadcast to every worker through one MessageQueue; each worker answers on its own.
A response thread resolves futures strictly in submission order; a blocking call sent while no
other call is unresolved reads its replies itself (a hand-over between threads costs more than
the step's messages). A monitor thread notices a dead worker, marks the executor failed and shuts
it down (both threads: executor/worker_calls.py). See
docs/executors.md.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from pdserve.config import EngineConfig
from pdserve.executor.base import Executor, worker_class
from pdserve.executor.message_queue import MessageQueue, MessageQueueHandle
from pdserve.executor.rpc import check_method, decode_reply, decode_results, encode_call
from pdserve.executor.worker_calls import WorkerCalls, wait_for_reply
from pdserve.executor.worker_proc import worker_main
from pdserve.utils import get_open_port, wait_for_ready

_STARTUP_TIMEOUT_S = 300.0
_GRACEFUL_EXIT_S = 5.0


@dataclass
class WorkerHandle:
    rank: int
    proc: BaseProcess
    death_writer: Connection
    response_mq: MessageQueue | None = None


@dataclass
class _PendingCall:
    method: str
    args: tuple[Any, ...]  # a result is decoded against its call's arguments
    ranks: list[int]
    single: bool


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel_config.world_size
        self.worker_cls = worker_class(config)  # its annotations type the RPC messages
        self.shutting_down = False
        self.workers: list[WorkerHandle] = []
        self._calls: WorkerCalls[_PendingCall] = WorkerCalls(
            self._resolve_queued, self._wait_for_death, self._worker_died
        )
        self._send_lock = threading.Lock()
        # Held by the thread that reads the response queues: the response thread, or a caller
        # reading its own replies. Calls sent and not resolved yet, under _send_lock:
        self._recv_lock = threading.Lock()
        self._num_unresolved = 0
        self.rpc_broadcast_mq: MessageQueue | None = MessageQueue(num_local_readers=self.world_size)
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._calls.start()

    def _start_workers(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        ready_readers = []
        for rank in range(self.world_size):
            ready_reader, ready_writer = ctx.Pipe(duplex=False)
            death_reader, death_writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=worker_main,
                name=f"pdserve-worker-{rank}",
                daemon=True,
                args=(
                    self.config,
                    rank,
                    rank,
                    init_method,
                    self.rpc_broadcast_mq.handle,
                    ready_writer,
                    death_reader,
                ),
            )
            proc.start()
            ready_writer.close()
            death_reader.close()
            self.workers.append(WorkerHandle(rank, proc, death_writer))
            ready_readers.append(ready_reader)
        for worker, reader in zip(self.workers, ready_readers):
            payload = wait_for_ready(
                worker.proc, reader, f"Worker rank {worker.rank}", _STARTUP_TIMEOUT_S
            )
            handle = msgspec.msgpack.decode(payload, type=MessageQueueHandle)
            worker.response_mq = MessageQueue.attach(handle, reader_rank=0)
        self.rpc_broadcast_mq.wait_until_ready()

    # ---- RPC -------------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        if self.is_failed or self.rpc_broadcast_mq is None:
            raise RuntimeError("Executor failed.")
        check_method(self.worker_cls, method)
        payload = encode_call(method, args, kwargs or {}, unique_reply_rank)
        ranks = list(range(self.world_size)) if unique_reply_rank is None else [unique_reply_rank]
        call = _PendingCall(method, args, ranks, unique_reply_rank is not None)
        with self._send_lock:  # a call's place in the queue is its place in every response order
            self.rpc_broadcast_mq.enqueue(payload)
            # Nothing unresolved: no thread reads the response queues, so this one may. A call
            # with a timeout leaves its replies to the response thread, which reads them all.
            direct = not non_block and timeout is None and self._num_unresolved == 0
            self._num_unresolved += 1
            if direct:
                self._recv_lock.acquire()
            else:
                future = self._calls.add(call)
        if direct:
            try:
                return self._read_replies(call)
            finally:
                self._recv_lock.release()
                self._call_resolved()
        return wait_for_reply(future, method, timeout, non_block)

    def _read_replies(self, call: _PendingCall) -> Any:
        # Every rank's reply is read before any error is raised: a reply left in a queue would
        # be taken as the answer to the next call.
        replies = [(rank, decode_reply(self._dequeue(self.workers[rank]))) for rank in call.ranks]
        results = decode_results(self.worker_cls, call.method, replies, call.args)
        return results[0] if call.single else results

    def _call_resolved(self) -> None:
        with self._send_lock:
            self._num_unresolved -= 1

    def _resolve_queued(self, call: _PendingCall) -> Any:
        try:
            with self._recv_lock:
                return self._read_replies(call)
        finally:
            self._call_resolved()  # before waking the caller, whose next call may read

    def _dequeue(self, worker: WorkerHandle) -> bytes:
        while True:
            if self.is_failed or self.shutting_down or worker.response_mq is None:
                raise RuntimeError("Executor failed.")
            try:
                return worker.response_mq.dequeue(timeout=1.0)
            except TimeoutError:
                continue

    # ---- failure and shutdown --------------------------------------------------------------

    def _wait_for_death(self) -> str | None:
        sentinels = {w.proc.sentinel: w for w in self.workers}
        died = wait(list(sentinels))
        if self.shutting_down:
            return None
        dead = sentinels[died[0]]
        return f"rank {dead.rank} (pid {dead.proc.pid})"

    def shutdown(self) -> None:
        if self.shutting_down:
            return
        self.shutting_down = True
        for w in self.workers:
            w.death_writer.close()  # EOF tells each worker its parent is leaving
        deadline = time.monotonic() + _GRACEFUL_EXIT_S
        for w in self.workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
        for sig_method, grace in (("terminate", 4.0), ("kill", 1.0)):
            alive = [w.proc for w in self.workers if w.proc.is_alive()]
            for proc in alive:
                getattr(proc, sig_method)()
            for proc in alive:
                proc.join(grace)
        self._calls.close()
        for w in self.workers:
            if w.response_mq is not None:
                w.response_mq.close()
                w.response_mq = None
        if self.rpc_broadcast_mq is not None:
            self.rpc_broadcast_mq.close()
            self.rpc_broadcast_mq = None
