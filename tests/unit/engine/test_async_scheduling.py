"""Async scheduling gives the tokens of synchronous scheduling: token-exact against HF greedy.

Modes: "sync" (async_scheduling=False); "async" (the default, in-process: each step is done
before the next is scheduled, only placeholders differ); "in_flight" (async with the in-process
worker deferred until the engine waits, so the engine always schedules a step ahead, as with a
busy worker process: decodes of tokens not known yet, tokens dropped after a stop or a
preemption). The multiprocess case at the end overlaps for real.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from pdserve import LLM, SamplingParams
from pdserve.outputs import ModelRunnerOutput
from pdserve.scheduler.output import SchedulerOutput
from tests.unit.engine.test_correctness import (
    MAX_TOKENS,
    RUNNERS,
    assert_pool_full,
    make_prompts,
    reference,
)

MODES = ["sync", "async", "in_flight"]


class DeferredFuture(Future):
    """A step the worker runs only when its result, or a later step's, is asked for."""

    def __init__(self, run: Callable[[], ModelRunnerOutput], pending: list[DeferredFuture]) -> None:
        super().__init__()
        self._run = run
        self._pending = pending
        pending.append(self)

    def result(self, timeout: float | None = None) -> Any:
        # The worker runs steps in submission order, as worker processes do.
        while not self.done():
            step = self._pending.pop(0)
            try:
                step.set_result(step._run())
            except Exception as e:
                step.set_exception(e)
        return super().result(timeout)


class Deferral:
    """Defers an LLM's in-process worker, counting what the worker does."""

    def __init__(self, llm: LLM) -> None:
        assert llm.engine_core is not None
        executor = llm.engine_core.executor
        self._execute_model = executor.execute_model
        self._pending: list[DeferredFuture] = []
        self.max_pending = 0  # steps submitted and not run, at most
        self.num_sampled = 0  # tokens the worker sampled, delivered or not
        executor.execute_model = self.submit  # type: ignore[method-assign]

    def submit(self, so: SchedulerOutput, non_block: bool = False) -> DeferredFuture:
        assert non_block
        future = DeferredFuture(lambda: self._run(so), self._pending)
        self.max_pending = max(self.max_pending, len(self._pending))
        return future

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        output = self._execute_model(so)
        self.num_sampled += sum(map(len, output.sampled_token_ids))
        return output


def make_llm(path: str, mode: str, **kwargs: Any) -> tuple[LLM, Deferral | None]:
    async_scheduling = False if mode == "sync" else None  # None: the default, on
    llm = LLM(
        model=path, dtype="float32", max_model_len=256, async_scheduling=async_scheduling, **kwargs
    )
    return llm, Deferral(llm) if mode == "in_flight" else None


def stopping_params(expected: list[list[int]]) -> tuple[list[SamplingParams], list[list[int]]]:
    """Per prompt, a stop token from its greedy output or a max_tokens, at different steps;
    returns the params and the outputs they cut the reference to."""
    params, cut = [], []
    for i, tokens in enumerate(expected):
        if i % 2:
            stop = tokens[i]
            n = tokens.index(stop) + 1
            params.append(
                SamplingParams(
                    temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop]
                )
            )
        else:
            n = 1 + 3 * i
            params.append(SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        cut.append(tokens[:n])
    return params, cut


def generate(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(params=list(RUNNERS))
def runner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[request.param])
    return request.param


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill(tiny_model: Callable[[str], str], runner: str, mode: str) -> None:
    path = tiny_model("llama")
    llm, deferral = make_llm(path, mode, max_num_batched_tokens=32, max_num_seqs=8)
    with llm:
        assert llm.engine_core.batch_queue_size == (1 if mode == "sync" else 2)
        prompts = make_prompts(llm.config.model_config.vocab_size, shared_prefix=20)
        assert generate(llm, prompts, GREEDY) == reference(path, prompts)
        assert_pool_full(llm)
        # Prefix hits on blocks cached while their tokens were in flight.
        assert generate(llm, prompts, GREEDY) == reference(path, prompts)
        assert_pool_full(llm)
    if deferral is not None:
        assert deferral.max_pending == 2


@pytest.mark.parametrize("mode", MODES)
def test_preemption(tiny_model: Callable[[str], str], runner: str, mode: str) -> None:
    path = tiny_model("llama")
    # 24 usable blocks of 16 tokens cannot hold 8 sequences of up to 127 tokens at once.
    llm, _ = make_llm(path, mode, num_gpu_blocks_override=25)
    with llm:
        prompts = make_prompts(llm.config.model_config.vocab_size)
        assert generate(llm, prompts, GREEDY) == reference(path, prompts)
        assert llm.engine_core.scheduler.make_stats().num_preemptions > 0
        assert_pool_full(llm)


@pytest.mark.parametrize("mode", MODES)
def test_stops_and_max_tokens(tiny_model: Callable[[str], str], runner: str, mode: str) -> None:
    path = tiny_model("llama")
    llm, deferral = make_llm(path, mode, num_gpu_blocks_override=25)
    with llm:
        prompts = make_prompts(llm.config.model_config.vocab_size)
        params, expected = stopping_params(reference(path, prompts))
        assert generate(llm, prompts, params) == expected
        assert_pool_full(llm)
    if deferral is not None:
        # Stopped requests had a step in flight: its tokens were sampled, then dropped.
        assert deferral.num_sampled > sum(map(len, expected))


def test_multiproc_tp2_overlaps(tiny_model: Callable[[str], str]) -> None:
    """Two worker processes compute a step while the engine schedules the next."""
    path = tiny_model("llama")
    with LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=25,
        distributed_executor_backend="mp",
        tensor_parallel_size=2,
    ) as llm:
        core = llm.engine_core
        step = core.step
        num_ahead = 0  # steps that only submitted: the previous one was still computing

        def counting_step() -> list:
            nonlocal num_ahead
            outputs = step()
            num_ahead += not outputs and bool(core.batch_queue)
            return outputs

        core.step = counting_step  # type: ignore[method-assign]
        prompts = make_prompts(llm.config.model_config.vocab_size)
        params, expected = stopping_params(reference(path, prompts))
        assert generate(llm, prompts, params) == expected
        assert generate(llm, prompts, GREEDY) == reference(path, prompts)
        assert core.scheduler.make_stats().num_preemptions > 0
        assert_pool_full(llm)
        assert num_ahead > 0
