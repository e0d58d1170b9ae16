"""Pipeline parallelism on the MultiprocExecutor (gloo on CPU): a TP=2 x PP=2 executor's ranks,
and PP=2's greedy output, HF's token for token with runner V1 and V2, through chunked prefill and
preemption (TP=2 x PP=2's tokens: test_parallel_matrix.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve import LLM
from pdserve.config import EngineConfig
from pdserve.executor.multiproc import MultiprocExecutor
from tests.unit.engine.test_correctness import assert_pool_full, make_prompts, reference, run

RUNNERS = {"v1": "0", "v2": "1"}


def make_llm(path: str, tp: int, runner: str, **kwargs: int) -> LLM:
    # A small step budget splits the longer prompts into chunks: steps in which no request
    # samples still pass activations from stage to stage.
    llm = LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        tensor_parallel_size=tp,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
        **kwargs,
    )
    assert llm.config.use_v2_model_runner is (runner == "v2")
    return llm


def short_prompts(llm: LLM) -> list[list[int]]:
    return make_prompts(llm.config.model_config.vocab_size)[::2]  # 3, 16, 31 and 64 tokens


def test_executor_tp2_pp2(tiny_model: Callable[[str], str]) -> None:
    config = EngineConfig.from_engine_args(
        model=tiny_model("llama"),
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="mp",
    )
    executor = MultiprocExecutor(config)
    try:
        assert executor.world_size == 4
        assert len(executor.workers) == 4
        assert executor.output_rank == 2  # the first TP rank of the last stage
        overlap = bool(config.scheduler_config.async_scheduling) and config.use_v2_model_runner
        assert executor.max_concurrent_batches == 2 + int(overlap)
        executor.check_health()
        assert executor.collective_rpc("determine_num_blocks") == [64] * 4
    finally:
        executor.shutdown()


# Each family and each runner once (the preemption test runs both runners again);
# TP=2 x PP=2 runs in test_parallel_matrix.py's cells, chunked the same way.
@pytest.mark.parametrize("arch,runner", [("llama", "v1"), ("qwen2_moe", "v2")])
def test_greedy_matches_hf(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, arch: str, runner: str
) -> None:
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[runner])
    path = tiny_model(arch)
    with make_llm(path, 1, runner) as llm:
        prompts = short_prompts(llm)
        assert run(llm, prompts) == reference(path, prompts)
        assert_pool_full(llm)


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_greedy_matches_hf_under_preemption(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, runner: str
) -> None:
    """Every rank drops and rebuilds a preempted request's state from the same messages."""
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[runner])
    path = tiny_model("opt")
    # 9 usable blocks of 16 tokens cannot hold the 4 sequences (16 blocks) at once.
    with make_llm(path, 1, runner, num_gpu_blocks_override=10) as llm:
        prompts = short_prompts(llm)
        assert run(llm, prompts) == reference(path, prompts)
        assert llm.engine_core.scheduler.make_stats().num_preemptions > 0
        assert_pool_full(llm)
