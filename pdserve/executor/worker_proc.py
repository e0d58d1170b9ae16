"""The main function of one worker process of the MultiprocExecutor."""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection

import msgspec

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.executor.base import worker_class
from pdserve.executor.message_queue import MessageQueue, MessageQueueHandle
from pdserve.executor.rpc import decode_args, decode_call, encode_reply
from pdserve.executor.worker import Worker
from pdserve.utils import FAILED, READY, exit_with_parent

logger = logging.getLogger(__name__)


def worker_main(
    config: EngineConfig,
    rank: int,
    local_rank: int,
    distributed_init_method: str,
    broadcast_handle: MessageQueueHandle,
    ready_writer: Connection,
    death_reader: Connection,
) -> None:
    # SIGTERM from the executor's shutdown: leave through SystemExit so finally-blocks run.
    exit_with_parent(death_reader)
    logging.basicConfig(level=envs.log_level())
    broadcast = response = None
    try:
        worker = worker_class(config)(
            config,
            rank=rank,
            local_rank=local_rank,
            distributed_init_method=distributed_init_method,
        )
        worker.init_distributed()
        worker.load_model()
        broadcast = MessageQueue.attach(broadcast_handle, local_rank)
        response = MessageQueue(num_local_readers=1)
        ready_writer.send((READY, msgspec.msgpack.encode(response.handle)))
    except BaseException as e:
        ready_writer.send((FAILED, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        ready_writer.close()

    try:
        response.wait_until_ready()
        _busy_loop(worker, rank, broadcast, response)
    except SystemExit:
        pass
    finally:
        worker.shutdown()
        for mq in (broadcast, response):
            mq.close()


def _busy_loop(worker: Worker, rank: int, broadcast: MessageQueue, response: MessageQueue) -> None:
    while True:
        try:
            call = decode_call(broadcast.dequeue())
        except msgspec.DecodeError:
            logger.exception("Rank %d dropped a message it could not decode", rank)
            continue
        replies = call.output_rank is None or call.output_rank == rank
        try:
            args, kwargs = decode_args(type(worker), call)
            result = getattr(worker, call.method)(*args, **kwargs)
            # Encoded here too: a result that cannot be encoded fails the call, not the loop.
            reply = encode_reply(True, result, args) if replies else b""
        except Exception as e:
            logger.exception("Rank %d failed in %s", rank, call.method)
            reply = encode_reply(False, f"{type(e).__name__}: {e}", ())
        if replies:
            response.enqueue(reply)
