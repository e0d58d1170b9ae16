"""The EngineCore process: a loop that drains inputs between steps and streams outputs.

Inputs arrive on a PULL socket, outputs leave on a PUSH socket (both ZMQ, msgpack). With
nothing to do, the loop blocks in `poll` on the input socket, so an idle engine costs no CPU.
A message that fails to decode is logged and dropped; a fatal error in a step is reported to
the front end in a last message, and then the process exits.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityCall,
    UtilityResult,
)
from pdserve.kv_transfer_params import KVTransferParams
from pdserve.utils import FAILED, READY, exit_with_parent

logger = logging.getLogger(__name__)

# An engine that only waits for KV transfers polls its workers after this long, doubling up to
# the maximum while nothing changes: a read ends within milliseconds, but a push-mode decode
# instance waits for a whole prefill, and each poll is a step through its workers.
_TRANSFER_POLL_MS = 2
_TRANSFER_POLL_MAX_MS = 16


class EngineCoreProc:
    def __init__(self, engine: EngineCore, input_addr: str, output_addr: str) -> None:
        self.engine = engine
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.connect(input_addr)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.connect(output_addr)
        self.encoder = msgspec.msgpack.Encoder()
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.abort_decoder = msgspec.msgpack.Decoder(list[str])
        self.utility_decoder = msgspec.msgpack.Decoder(UtilityCall)
        self.utilities: dict[str, Callable[..., Any]] = {
            "get_stats": self.engine.get_stats,
            "reset_prefix_cache": self.engine.reset_prefix_cache,
            # Utility arguments arrive as plain msgpack: the params are typed again here.
            "release_remote_kv": lambda request_id, params: self.engine.release_remote_kv(
                request_id, msgspec.convert(params, KVTransferParams)
            ),
        }

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        poll_ms = _TRANSFER_POLL_MS
        idle_poll_s = self.engine.kv_connector.idle_poll_s()
        idle_ms = None if idle_poll_s is None else int(idle_poll_s * 1000)
        while True:
            # Block when idle; a busy engine picks up new inputs between two steps; one that
            # only waits for KV transfers polls its workers every few milliseconds, not in a spin.
            if not self.engine.has_work():
                timeout = idle_ms
            elif self.engine.last_step_scheduled or self.engine.batch_queue:
                timeout = 0
            else:
                timeout = poll_ms
            events = poller.poll(timeout)
            rejected: dict[str, str] = {}
            changed = bool(events) and self._drain_inputs(rejected)
            outputs = self.engine.step()
            quiet = timeout == poll_ms and not (outputs or changed or rejected)
            poll_ms = min(2 * poll_ms, _TRANSFER_POLL_MAX_MS) if quiet else _TRANSFER_POLL_MS
            if outputs or changed or rejected:
                scheduler_stats, kv_stats = self.engine.get_stats()
                self._send(
                    EngineCoreOutputs(
                        time.time(), outputs, scheduler_stats, kv_stats, rejected=rejected or None
                    )
                )

    def _drain_inputs(self, rejected: dict[str, str]) -> bool:
        changed = False
        while True:
            try:
                frames = self.input_socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed
            try:
                changed |= self._handle(frames, rejected)
            except (msgspec.DecodeError, ValueError, KeyError) as e:
                logger.warning("Dropped a message the engine could not decode: %s", e)

    def _handle(self, frames: list[zmq.Frame], rejected: dict[str, str]) -> bool:
        if len(frames) != 2:
            raise ValueError(f"expected 2 frames, got {len(frames)}")
        kind, payload = EngineCoreRequestType(frames[0].bytes), frames[1].buffer
        if kind is EngineCoreRequestType.ADD:
            try:
                request = self.request_decoder.decode(payload)
            except (msgspec.DecodeError, ValueError) as e:
                # Refused with its id, if it has one: its client must not wait forever.
                fields = msgspec.msgpack.decode(payload)
                if not (isinstance(fields, list) and fields and isinstance(fields[0], str)):
                    raise
                rejected[fields[0]] = f"The engine could not read the request: {e}"
                return True
            try:
                self.engine.add_request(request)
            except ValueError as e:
                rejected[request.request_id] = str(e)
            return True
        if kind is EngineCoreRequestType.ABORT:
            self.engine.abort_requests(self.abort_decoder.decode(payload))
            return True
        call = self.utility_decoder.decode(payload)
        result = UtilityResult(call.call_id)
        try:
            result.result = self.utilities[call.method](*call.args)
        except Exception as e:
            result.error = f"{type(e).__name__}: {e}"
        self._send(EngineCoreOutputs(time.time(), utility_result=result))
        return False

    def _send(self, outputs: EngineCoreOutputs) -> None:
        self.output_socket.send(self.encoder.encode(outputs), copy=False)

    def close(self, error: str | None = None) -> None:
        if error is not None:
            self._send(EngineCoreOutputs(time.time(), engine_error=error))
        self.input_socket.close(linger=0)
        # The last message (an error report) must reach the front end before we exit.
        self.output_socket.close(linger=1000)
        self.ctx.term()


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    ready_writer: Connection,
    death_reader: Connection,
) -> None:
    exit_with_parent(death_reader)
    logging.basicConfig(level=envs.log_level(), format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = EngineCore(config)
        proc = EngineCoreProc(engine, input_addr, output_addr)
        ready_writer.send((READY, engine.num_blocks))
    except BaseException as e:
        ready_writer.send((FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        ready_writer.close()
    error = None
    try:
        proc.run()
    except SystemExit:
        pass
    except BaseException as e:
        logger.exception("The engine core failed")
        error = f"{type(e).__name__}: {e}"
        raise SystemExit(1) from None
    finally:
        proc.close(error)
        engine.shutdown()
