"""UniProcExecutor: one worker in the engine's own process."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from pdserve.config import EngineConfig
from pdserve.executor.base import Executor, worker_class
from pdserve.executor.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker: Worker | None = worker_class(config)(config, rank=0)
        self.worker.load_model()

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        if self.worker is None:
            raise RuntimeError("Executor is shut down.")
        future: Future[Any] = Future()
        try:
            result = getattr(self.worker, method)(*args, **(kwargs or {}))
        except Exception as e:
            if not non_block:
                raise
            future.set_exception(e)
        else:
            if unique_reply_rank is None:
                result = [result]
            if not non_block:
                return result
            future.set_result(result)
        return future

    def shutdown(self) -> None:
        self.worker = None
