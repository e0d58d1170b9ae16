"""The Executor contract: how the engine drives its workers, whatever their placement."""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pdserve.config import EngineConfig
from pdserve.config.plugins import EXECUTORS
from pdserve.kv_connector.aggregator import KVOutputAggregator
from pdserve.outputs import ModelRunnerOutput
from pdserve.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from pdserve.executor.worker import Worker

logger = logging.getLogger(__name__)


def worker_class(config: EngineConfig) -> type[Worker]:
    """The class named by `parallel_config.worker_cls`."""
    from pdserve.executor.worker import Worker

    module_name, _, class_name = config.parallel_config.worker_cls.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise ValueError(
            f"worker_cls {config.parallel_config.worker_cls!r} is not a Worker subclass."
        )
    return cls


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.is_failed = False
        # With a KV connector every rank's transfer report counts, not just the output rank's.
        self.kv_output_aggregator = (
            KVOutputAggregator(config.parallel_config.world_size)
            if config.kv_transfer_config is not None
            else None
        )

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.distributed_executor_backend
        assert backend is not None, "ParallelConfig picks a backend"
        try:
            return EXECUTORS.get(backend)
        except ImportError as e:
            if (e.name or "").partition(".")[0] != "ray":
                raise
            raise ValueError(
                "distributed_executor_backend='ray' needs Ray: pip install 'pdserve[ray]'."
            ) from e

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call `method` on every worker; a list of results (or one, with unique_reply_rank)."""

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        aggregator = self.kv_output_aggregator
        if aggregator is None:
            return self.collective_rpc(
                "execute_model",
                args=(scheduler_output,),
                non_block=non_block,
                unique_reply_rank=self.output_rank,
            )
        result = self.collective_rpc("execute_model", args=(scheduler_output,), non_block=non_block)
        if not non_block:
            return aggregator.aggregate(result, self.output_rank)
        aggregated: Future[ModelRunnerOutput] = Future()

        def done(future: Future[list[ModelRunnerOutput]]) -> None:
            try:
                aggregated.set_result(aggregator.aggregate(future.result(), self.output_rank))
            except BaseException as e:
                aggregated.set_exception(e)

        result.add_done_callback(done)
        return aggregated

    def determine_num_blocks(self) -> int:
        # Every rank must hold the same block ids, so the smallest budget wins.
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", args=(num_blocks,))

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    @property
    def output_rank(self) -> int:
        """The first TP rank of the last pipeline stage returns the sampled tokens."""
        par = self.config.parallel_config
        return par.world_size - par.tensor_parallel_size

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.max_concurrent_batches

    def _worker_died(self, worker: str) -> None:
        """A worker died outside shutdown: every later call fails (the engine's next step ends
        it), and the other workers are released."""
        logger.error("Worker %s died unexpectedly, shutting down executor.", worker)
        self.is_failed = True
        self.shutdown()

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers; safe to call more than once."""
