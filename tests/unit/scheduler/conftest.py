"""Builders for scheduler tests, and the no-leak check every test ends with."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import pytest

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.outputs import EngineCoreOutput, ModelRunnerOutput
from pdserve.request import Request
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pdserve.scheduler.output import SchedulerOutput
from pdserve.scheduler.scheduler import Scheduler

EOS = 2
BLOCK_SIZE = 4


def free_blocks(queue: FreeKVCacheBlockQueue) -> list[KVCacheBlock]:
    """The queue's blocks, least recently freed first, by walking its links."""
    blocks = []
    block = queue.fake_head.next_free_block
    while block is not None and block is not queue.fake_tail:
        blocks.append(block)
        block = block.next_free_block
    return blocks


def assert_pool_full(pool: BlockPool) -> None:
    """Invariant 2: every usable block free again, every reference dropped."""
    assert pool.get_num_free_blocks() == pool.num_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.null_block not in free_blocks(pool.free_block_queue)


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    assert not scheduler.requests and not scheduler.remote_kv.finished_recving_kv_req_ids
    assert not scheduler.running and not scheduler.waiting
    assert not scheduler.remote_kv.skipped_waiting
    assert not scheduler.kv_cache_manager.req_to_blocks
    assert not scheduler.kv_cache_manager.num_cached_block
    assert_pool_full(scheduler.kv_cache_manager.block_pool)


@pytest.fixture
def pools() -> Iterator[list[BlockPool]]:
    """Block pools a test registers; each must be full again when the test ends."""
    created: list[BlockPool] = []
    yield created
    for pool in created:
        assert_pool_full(pool)


@pytest.fixture
def make_scheduler(pools: list[BlockPool]) -> Iterator[Callable[..., Scheduler]]:
    created: list[Scheduler] = []

    def make(
        num_blocks: int = 64,
        max_model_len: int = 256,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 64,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        use_v2_model_runner: bool = False,
        block_size: int = BLOCK_SIZE,
        kv_connector: object | None = None,
    ) -> Scheduler:
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                policy=policy,
            ),
            CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            use_v2_model_runner=use_v2_model_runner,
            kv_connector=kv_connector,
        )
        created.append(scheduler)
        pools.append(scheduler.kv_cache_manager.block_pool)
        return scheduler

    yield make
    for scheduler in created:
        assert_scheduler_empty(scheduler)


def make_request(
    request_id: str | int,
    prompt: list[int] | int = 8,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    **sampling: object,
) -> Request:
    """A request whose prompt is the given tokens, or that many tokens unique to it."""
    if isinstance(prompt, int):
        base = 1000 * (zlib.crc32(str(request_id).encode()) % 100_000 + 1)
        prompt = [base + i for i in range(prompt)]
    return Request(
        request_id=str(request_id),
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        eos_token_id=EOS,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
    )


def runner_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    token: int | Callable[[Request], int] = 7,
) -> ModelRunnerOutput:
    """What a model runner returns: one token for each request whose known tokens are all
    computed after this step, nothing for a request in the middle of its prefill."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens < request.num_tokens:
            sampled.append([])
        else:
            sampled.append([token(request) if callable(token) else token])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def step(
    scheduler: Scheduler, token: int | Callable[[Request], int] = 7
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(
        scheduler_output, runner_output(scheduler, scheduler_output, token)
    )
    return scheduler_output, outputs


def run_to_completion(
    scheduler: Scheduler, token: int | Callable[[Request], int] = 7, max_steps: int = 1000
) -> dict[str, list[int]]:
    """Step until no request is left; returns every request's generated tokens."""
    generated: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = step(scheduler, token)
        for out in outputs:
            generated.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not scheduler.has_unfinished_requests(), "requests left after max_steps"
    scheduler.schedule()  # carries the last finished ids to the workers
    return generated
