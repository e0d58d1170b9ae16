"""Worker: one rank's device, model runner and KV cache."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.distributed import parallel_state
from pdserve.executor.cpu_cores import FixedThreads, cpu_threads
from pdserve.kv_connector.base import KVConnectorWorker
from pdserve.kv_connector.factory import create_worker_connector
from pdserve.kv_connector.noop import NoKVConnectorWorker
from pdserve.outputs import ModelRunnerOutput
from pdserve.runners.base import ModelRunnerBase
from pdserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
            self.threads = FixedThreads()
        else:
            self.threads = cpu_threads(config.parallel_config.world_size)
        if config.use_v2_model_runner:
            from pdserve.runners.v2.model_runner import ModelRunnerV2 as runner_cls
        else:
            from pdserve.runners.v1.model_runner import ModelRunnerV1 as runner_cls
        logger.info("Rank %d uses %s", rank, runner_cls.__name__)
        self.model_runner: ModelRunnerBase = runner_cls(config, self.device)
        # Until the KV cache exists there is nothing to connect.
        self.kv_connector: KVConnectorWorker = NoKVConnectorWorker()

    def init_distributed(self) -> None:
        """Join the world; set this rank's tensor-parallel group and pipeline (stage-major)."""
        par = self.config.parallel_config
        if par.world_size == 1:
            return
        assert self.distributed_init_method is not None
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend,
            init_method=self.distributed_init_method,
            world_size=par.world_size,
            rank=self.rank,
        )
        tp = par.tensor_parallel_size
        if par.pipeline_parallel_size == 1:
            # The world is the TP group. A second group would cost each rank a second gloo loop
            # thread, and each wakes 100 times a second while the engine idles.
            parallel_state.init_tensor_model_parallel(dist.group.WORLD)
            return
        # Every rank creates every group, in the same order, as torch.distributed requires.
        for stage in range(par.pipeline_parallel_size):
            ranks = list(range(stage * tp, (stage + 1) * tp))
            group = dist.new_group(ranks)
            if self.rank in ranks:
                parallel_state.init_tensor_model_parallel(group)
        # Stages talk point to point, so a pipeline needs its ranks but no group of its own.
        parallel_state.init_pipeline_model_parallel(
            range(self.rank % tp, par.world_size, tp), self.rank
        )

    def load_model(self) -> None:
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner.load_model()
        self.threads.model_loaded(self.model_runner.model)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            # vLLM's meaning: the instance (weights, loaded by now, and KV cache) fills at most
            # this fraction of the device; what others hold counts against it too.
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cache.gpu_memory_utilization) - (total - free)
            if budget <= 0:
                raise ValueError(
                    f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves no room for "
                    f"the KV cache: {(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB are "
                    "in use already."
                )
        else:
            budget = int(envs.cpu_kv_cache_space_gib() * 2**30)
        num_blocks = budget // self.model_runner.get_kv_cache_block_bytes()
        # More blocks than every sequence at full length can use is wasted memory.
        runner = self.model_runner
        useful = runner.max_num_reqs * runner.max_num_blocks_per_req + 1
        return max(2, min(num_blocks, useful))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        tp_rank = self.rank % self.config.parallel_config.tensor_parallel_size
        self.kv_connector = create_worker_connector(self.config, tp_rank)
        assert self.model_runner.kv_cache is not None
        self.kv_connector.register_kv_caches(self.model_runner.kv_cache)

    def get_kv_connector_handshake_metadata(self) -> bytes | None:
        return self.kv_connector.get_handshake_metadata()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        connector = self.kv_connector
        connector.pre_forward(scheduler_output)
        self.threads.before_step(scheduler_output)
        output = self.model_runner.execute_model(scheduler_output)
        kv_output = connector.post_forward(scheduler_output)
        return output if kv_output is None else output.with_kv_connector_output(kv_output)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.kv_connector.shutdown()
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
