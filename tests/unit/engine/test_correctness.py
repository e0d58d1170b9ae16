"""Token-exact greedy output against HF transformers, for every architecture and runner."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams
from tests.utils.tiny_models import hf_greedy

ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "opt",
    "gemma2",
    "qwen2_moe",
    "mixtral",
    "granitemoe",
    "deepseek_v2",
    "deepseek_v3",
]
RUNNERS = {"v1": "0", "v2": "1"}
MAX_TOKENS = 32
PROMPT_LENS = [3, 9, 16, 17, 31, 40, 64, 95]  # block boundaries (16) and partial blocks


def make_prompts(vocab_size: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(1234)
    prefix = [rng.randrange(4, vocab_size) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(4, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


_reference_cache: dict[tuple, list[list[int]]] = {}


def reference(path: str, prompts: list[list[int]]) -> list[list[int]]:
    key = (path, tuple(map(tuple, prompts)))
    if key not in _reference_cache:
        _reference_cache[key] = hf_greedy(path, prompts, MAX_TOKENS)
    return _reference_cache[key]


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_full(llm: LLM) -> None:
    core = llm.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == core.num_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.fixture(params=list(RUNNERS))
def runner(request, monkeypatch) -> str:
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[request.param])
    return request.param


def make_llm(path: str, runner: str, **kwargs) -> LLM:
    llm = LLM(model=path, dtype="float32", max_model_len=256, **kwargs)
    assert llm.config.use_v2_model_runner is (runner == "v2")
    return llm


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_with_prefix_hits(tiny_model, runner, arch):
    path = tiny_model(arch)
    with make_llm(path, runner) as llm:
        prompts = make_prompts(llm.config.model_config.vocab_size, shared_prefix=20)
        expected = reference(path, prompts)
        assert run(llm, prompts) == expected
        assert_pool_full(llm)
        # The same prompts again hit the prefix cache for every full block.
        hits_before = llm.engine_core.scheduler.make_stats().prefix_cache_hits
        assert run(llm, prompts) == expected
        assert llm.engine_core.scheduler.make_stats().prefix_cache_hits > hits_before
        assert_pool_full(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_chunked_prefill(tiny_model, runner, arch):
    path = tiny_model(arch)
    with make_llm(path, runner, max_num_batched_tokens=32, max_num_seqs=8) as llm:
        prompts = make_prompts(llm.config.model_config.vocab_size)
        assert run(llm, prompts) == reference(path, prompts)
        assert_pool_full(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_under_preemption(tiny_model, runner, arch):
    path = tiny_model(arch)
    # 24 usable blocks of 16 tokens cannot hold 8 sequences of up to 127 tokens at once.
    with make_llm(path, runner, num_gpu_blocks_override=25) as llm:
        prompts = make_prompts(llm.config.model_config.vocab_size)
        assert run(llm, prompts) == reference(path, prompts)
        assert llm.engine_core.scheduler.make_stats().num_preemptions > 0
        assert_pool_full(llm)
