"""--kv-cache-dtype fp8 through the engine: twice the blocks in the same memory, a request's
tokens the same alone as in a batch, near the bf16 cache's logprobs, pools full after, and what
it does not serve yet refused by name."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.models.layers.attention import Attention
from tests.unit.engine.test_correctness import assert_pool_full

PROMPTS = ["What is the capital of Germany?", "Name three primary colors.", "Count to five."]
MEMORY = 64 * 2**20


def _run(llm: LLM, prompts: list[str]) -> list:
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=1)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_doubles_the_blocks_and_stays_batch_invariant(kv_cache_dtype: str) -> None:
    with LLM(max_model_len=512, kv_cache_memory_bytes=MEMORY) as llm:
        bf16_blocks = llm.engine_core.num_blocks
        reference = _run(llm, PROMPTS[:1])[0]
    with LLM(max_model_len=512, kv_cache_memory_bytes=MEMORY, kv_cache_dtype=kv_cache_dtype) as llm:
        # The bytes of a block halve, so the same memory holds twice the blocks.
        assert llm.engine_core.num_blocks == 2 * bf16_blocks
        batched = _run(llm, PROMPTS)
        alone = [_run(llm, [p])[0] for p in PROMPTS]
        assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
        assert_pool_full(llm)
    # The first token's logprob moves little: fp8 rounds each key and value by at most 2^-4
    # (e4m3) or 2^-3 (e5m2) of itself.
    first = batched[0]
    assert first.token_ids[0] == reference.token_ids[0]
    token = reference.token_ids[0]
    drift = abs(first.logprobs[0][token].logprob - reference.logprobs[0][token].logprob)
    assert drift < 0.3


def _scales(llm: LLM) -> list:
    model = llm.engine_core.executor.worker.model_runner.model
    return [m.kv_scale for m in model.modules() if isinstance(m, Attention)]


def test_calculated_scales_are_the_same_on_every_start() -> None:
    """From a fixed text, not the first batch (runners/kv_scales.py): two starts agree, and the
    answers stay near the bf16 cache's."""
    args = {"max_model_len": 512, "kv_cache_dtype": "fp8", "calculate_kv_scales": True}
    with LLM(**args) as llm:
        scales = _scales(llm)
        chat = [{"role": "user", "content": PROMPTS[0]}]
        answer = llm.chat(chat, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    with LLM(**args) as llm:
        assert _scales(llm) == scales
    assert len(set(scales)) > 1 and (1.0, 1.0) not in scales
    assert "Berlin" in answer[0].outputs[0].text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of 'auto', 'fp8', "),
        ({"kv_cache_dtype": "fp8", "model": "mamba"}, "for MambaForCausalLM's state rows"),
        ({"kv_cache_dtype": "fp8_e5m2", "model": "deepseek_v2"}, "latent cache \\(MLA\\)"),
        ({"calculate_kv_scales": True}, "calculate_kv_scales scales an fp8 cache"),
        (
            {"kv_cache_dtype": "fp8", "calculate_kv_scales": True, "pipeline_parallel_size": 2},
            "with calculate_kv_scales and more than one worker",
        ),
    ],
)
def test_what_fp8_does_not_serve_is_named(tiny_model, args, message) -> None:
    if "model" in args:
        args = {**args, "model": tiny_model(args["model"])}
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_engine_args(**args)
