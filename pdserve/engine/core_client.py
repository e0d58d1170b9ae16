"""The front end's handle on the EngineCore process: start it, feed it, read it, watch it die.

Requests go out on a PUSH socket (a send does not block the event loop while the engine's socket
is connected: ZMQ queues it); outputs come back on an asyncio PULL socket read by one task. A
thread waits on the process sentinel so that a killed engine is noticed at once, not at the next
request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_objects
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdserve.config import EngineConfig
from pdserve.engine.core_proc import run_engine_core
from pdserve.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityCall,
)
from pdserve.executor.zmq_utils import make_ipc_address
from pdserve.utils import wait_for_ready

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0
_SHUTDOWN_GRACE_S = 15.0
# A PUSH socket with no peer blocks a send: for a moment after start-up, before the engine's
# socket is attached, and for good once the engine is gone (a SIGTERM to the whole process group
# ends it beside this process, before the sentinel's thread has said so). A send waits this long
# at a time, then looks whether the engine still runs.
_SEND_WAIT_MS = 100


class EngineDeadError(RuntimeError):
    """The engine process is gone: every request in flight, and every new one, fails."""


class AsyncEngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        self.ctx = zmq.Context()
        self.async_ctx = zmq.asyncio.Context()
        input_addr, output_addr = make_ipc_address("engine-in"), make_ipc_address("engine-out")
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.setsockopt(zmq.SNDTIMEO, _SEND_WAIT_MS)
        self.input_socket.bind(input_addr)
        self.output_socket = self.async_ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.bind(output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self.dead_reason: str | None = None
        self.shutting_down = False
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, asyncio.Future[Any]] = {}
        self._output_task: asyncio.Task[None] | None = None

        ctx = multiprocessing.get_context("spawn")
        ready_reader, ready_writer = ctx.Pipe(duplex=False)
        death_reader, self._death_writer = ctx.Pipe(duplex=False)
        # Not a daemon: the engine starts worker processes of its own.
        self.proc = ctx.Process(
            target=run_engine_core,
            name="pdserve-engine-core",
            args=(config, input_addr, output_addr, ready_writer, death_reader),
        )
        self.proc.start()
        ready_writer.close()
        death_reader.close()
        try:
            wait_for_ready(self.proc, ready_reader, "The engine process", _STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def start(
        self, on_outputs: Callable[[EngineCoreOutputs], None], on_dead: Callable[[str], None]
    ) -> None:
        """Begin reading outputs; needs the running event loop that will serve requests."""
        loop = asyncio.get_running_loop()
        self._on_dead = on_dead
        self._output_task = loop.create_task(self._read_outputs(on_outputs))

        def watch() -> None:
            wait_for_objects([self.proc.sentinel])
            if self.shutting_down:
                return
            self.proc.join()  # the sentinel can fire before the exit code is there to read
            if not self.shutting_down:
                loop.call_soon_threadsafe(self._exited, self.proc.exitcode)

        threading.Thread(target=watch, name="pdserve-engine-monitor", daemon=True).start()

    async def _read_outputs(self, on_outputs: Callable[[EngineCoreOutputs], None]) -> None:
        while True:
            frame = await self.output_socket.recv(copy=False)
            try:
                outputs = self.decoder.decode(frame.buffer)
            except msgspec.DecodeError:
                logger.exception("Dropped an engine output that could not be decoded")
                continue
            if outputs.utility_result is not None:
                future = self._pending_calls.pop(outputs.utility_result.call_id, None)
                if future is not None and not future.done():
                    future.set_result(outputs.utility_result)
            if outputs.engine_error is not None:
                self._mark_dead(f"The engine failed: {outputs.engine_error}")
            try:
                on_outputs(outputs)
            except Exception:
                logger.exception("Processing engine outputs failed")

    def _exited(self, exitcode: int | None) -> None:
        if exitcode == 0:
            # The engine exits 0 only on SIGTERM, which a stop sent to the whole process group
            # (a terminal's `kill -- -PGID`, systemd) gives it beside this server: an orderly
            # stop, not a failure.
            self._mark_dead("The engine process stopped on SIGTERM.", logging.INFO)
        else:
            self._mark_dead(f"The engine process exited unexpectedly (exit code {exitcode}).")

    def _mark_dead(self, reason: str, level: int = logging.ERROR) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.log(level, "%s In-flight requests fail; /health answers 503.", reason)
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._pending_calls.clear()
        self._on_dead(reason)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _send(self, kind: EngineCoreRequestType, payload: bytes) -> None:
        """Raises EngineDeadError rather than block on an engine that is gone."""
        self._check_alive()
        while True:
            try:
                self.input_socket.send_multipart((kind.value, payload), copy=False)
                return
            except zmq.Again:
                if not self.proc.is_alive():
                    raise EngineDeadError("The engine process is gone.") from None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, self.encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            try:
                self._send(EngineCoreRequestType.ABORT, self.encoder.encode(request_ids))
            except EngineDeadError:
                pass  # a gone engine holds nothing to abort

    async def call_utility(self, method: str, *args: Any, timeout: float = 10.0) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = future
        try:
            self._send(
                EngineCoreRequestType.UTILITY,
                self.encoder.encode(UtilityCall(call_id, method, list(args))),
            )
            result = await asyncio.wait_for(future, timeout)
        finally:
            self._pending_calls.pop(call_id, None)
        if result.error is not None:
            raise RuntimeError(f"Engine utility {method!r} failed: {result.error}")
        return result.result

    def shutdown(self) -> None:
        """Idempotent: stops the engine (which stops its workers) and closes the sockets."""
        if self.shutting_down:
            return
        self.shutting_down = True
        if self._output_task is not None:
            self._output_task.cancel()
        # Closing our end of the death pipe tells the engine to leave through its cleanup.
        self._death_writer.close()
        self.proc.join(_SHUTDOWN_GRACE_S)
        if self.proc.is_alive():
            logger.warning(
                "The engine process did not stop in %.0f s; killing it", _SHUTDOWN_GRACE_S
            )
            self.proc.kill()
            self.proc.join(5)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        self.async_ctx.term()
