"""RayWorker: one rank of the RayExecutor, a Ray actor that runs msgspec-encoded calls.

Imported only by ray_executor.py, after it has checked that Ray is installed.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import ray

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.executor.rpc import decode_args, decode_call, encode_reply
from pdserve.executor.worker import Worker
from pdserve.utils import get_open_port

logger = logging.getLogger(__name__)


@ray.remote(concurrency_groups={"monitor": 1})
class RayWorker:
    """One rank in a Ray actor: a Worker that runs encoded calls."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.rank = -1

    def node_info(self) -> tuple[str, str, int]:
        """(node id, node IP, a free port on it): rank 0's IP and port host the TCP store."""
        ip = ray.util.get_node_ip_address()
        return ray.get_runtime_context().get_node_id(), ip, get_open_port(ip)

    def setup(self, config: EngineConfig, rank: int, distributed_init_method: str) -> None:
        logging.basicConfig(level=envs.log_level())
        self.rank = rank
        # On a GPU, Ray makes only this actor's device visible, so it is always cuda:0.
        self.worker = Worker(
            config, rank=rank, local_rank=0, distributed_init_method=distributed_init_method
        )
        self.worker.init_distributed()
        self.worker.load_model()

    def call(self, payload: bytes) -> bytes:
        """Run one encoded call; the encoded reply (only the reply ranks' are read)."""
        try:
            call = decode_call(payload)
            args, kwargs = decode_args(Worker, call)
            return encode_reply(True, getattr(self.worker, call.method)(*args, **kwargs), args)
        except msgspec.DecodeError as e:
            # Answered rather than dropped: the executor waits for a reply to every call.
            logger.exception("Rank %d could not decode a call", self.rank)
            return encode_reply(False, f"DecodeError: {e}", ())
        except Exception as e:
            logger.exception("Rank %d failed in a call", self.rank)
            return encode_reply(False, f"{type(e).__name__}: {e}", ())

    @ray.method(concurrency_group="monitor")
    def wait_for_death(self) -> None:
        threading.Event().wait()  # returns only as an error, when the actor dies
