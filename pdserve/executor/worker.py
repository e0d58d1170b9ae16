"""Worker: one rank's device, model runner and KV cache."""

from __future__ import annotations

import logging

import torch

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.outputs import ModelRunnerOutput
from pdserve.runners.base import ModelRunnerBase
from pdserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device(config.device)
        if config.use_v2_model_runner:
            from pdserve.runners.v2.model_runner import ModelRunnerV2 as runner_cls
        else:
            from pdserve.runners.v1.model_runner import ModelRunnerV1 as runner_cls
        logger.info("Rank %d uses %s", rank, runner_cls.__name__)
        self.model_runner: ModelRunnerBase = runner_cls(config, self.device)

    def load_model(self) -> None:
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        override = self.config.cache_config.num_gpu_blocks_override
        if override is not None:
            return override
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.8)
        else:
            budget = int(envs.cpu_kv_cache_space_gib() * 2**30)
        num_blocks = budget // self.model_runner.get_kv_cache_block_bytes()
        # More blocks than every sequence at full length can use is wasted memory.
        runner = self.model_runner
        useful = runner.max_num_reqs * runner.max_num_blocks_per_req + 1
        return max(2, min(num_blocks, useful))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def check_health(self) -> None:
        return None
