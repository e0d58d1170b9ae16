"""EngineCore: the step loop that ties scheduler and executor together."""

from __future__ import annotations

import logging
from typing import Iterable

from pdserve.config import EngineConfig
from pdserve.executor.base import Executor
from pdserve.outputs import EngineCoreOutput
from pdserve.request import Request, RequestStatus
from pdserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = Executor.get_class(config)(config)
        try:
            self.num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_kv_cache(self.num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            config.model_config.max_model_len,
            self.num_blocks,
            config.use_v2_model_runner,
        )

    def add_request(self, request: Request) -> None:
        max_model_len = self.config.model_config.max_model_len
        if request.num_prompt_tokens == 0:
            raise ValueError("The prompt is empty.")
        if request.num_prompt_tokens >= max_model_len:
            raise ValueError(
                f"The prompt has {request.num_prompt_tokens} tokens, which leaves no room for "
                f"a generated token within max_model_len={max_model_len}."
            )
        self.scheduler.add_request(request)

    def abort_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        self.scheduler.finish_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        # A step also runs to tell the workers which requests finished since the last one.
        if not (self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()):
            return []
        scheduler_output = self.scheduler.schedule()
        model_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def shutdown(self) -> None:
        self.executor.shutdown()
