"""Models with recurrent state (Mamba) on Model Runner V1: token-exact against HF transformers
alone, in batches, with chunked prefill at several budgets and with fewer state slots than
requests; every block (a state model's block is a request's state slot) back after each run;
what they do not do yet refused by name.

A request takes its one block at admission and never needs another, so nothing preempts an
attention-free model's requests: a short pool makes them wait for a slot instead."""

from __future__ import annotations

import logging

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from tests.unit.engine.test_correctness import (
    MAX_TOKENS,
    assert_pool_full,
    make_prompts,
    reference,
    run,
)

ENGINES = {
    "batched": {},
    # Qwen3.5 computes a prompt in whole chunks of 64 tokens: its budgets hold one.
    "chunked-small": {"max_num_batched_tokens": {"mamba": 16, "qwen3_5": 64}, "max_num_seqs": 8},
    "chunked-large": {"max_num_batched_tokens": {"mamba": 40, "qwen3_5": 100}, "max_num_seqs": 8},
    # 3 state slots for 8 prompts: they take turns.
    "three-slots": {"num_gpu_blocks_override": 4},
}


@pytest.fixture
def v1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_USE_V2_MODEL_RUNNER", raising=False)


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("arch", ["mamba", "qwen3_5"])
def test_state_model_matches_hf(tiny_model, v1, arch: str, engine: str) -> None:
    path = tiny_model(arch)
    args = {k: v[arch] if isinstance(v, dict) else v for k, v in ENGINES[engine].items()}
    with LLM(model=path, dtype="float32", max_model_len=256, **args) as llm:
        assert llm.config.use_v2_model_runner is False  # the rule, not a fallback
        assert llm.config.cache_config.enable_prefix_caching is False
        prompts = make_prompts(llm.config.model_config.vocab_size)
        assert run(llm, prompts) == reference(path, prompts)
        # One prompt alone continues from the same state machinery.
        assert run(llm, prompts[:1]) == reference(path, prompts)[:1]
        assert llm.config.cache_config.block_size == 256  # one block a request: its state
        assert_pool_full(llm)


@pytest.mark.parametrize("arch", ["mamba", "qwen3_5"])
def test_aborts_mid_prompt_and_mid_decode_free_their_slots(tiny_model, v1, arch: str) -> None:
    """Half the requests aborted after three steps (some mid-prompt under a 64-token budget,
    some decoding): their slots come back, and the others, whose later steps reuse them for
    nothing, keep HF's tokens."""
    path = tiny_model(arch)
    with LLM(
        model=path, dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8
    ) as llm:
        prompts = make_prompts(llm.config.model_config.vocab_size)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        ids = [llm._add_request({"prompt_token_ids": p}, params) for p in prompts]
        for _ in range(3):  # what these steps sample is the survivors' first tokens
            llm.output_processor.process_outputs(llm.engine_core.step())
        llm._abort(ids[::2])
        outputs = llm._run_engine(ids[1::2], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference(path, prompts)[1::2]
        assert_pool_full(llm)


@pytest.mark.parametrize("arch", ["mamba", "qwen3_5"])
def test_preempted_requests_recompute_their_state(tiny_model, v1, arch: str) -> None:
    """Nothing preempts a state model's request by itself (it never needs a second block), so
    the test preempts requests as the scheduler does, mid-prompt and mid-decode, some resumed at
    the very next step (the runner must drop the old slot, not keep it first in the row's block
    table): they come back with their new slots' state zeroed, recompute it, and keep HF's
    tokens, and no other request's slot is touched."""
    path = tiny_model(arch)
    with LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        async_scheduling=False,
    ) as llm:
        prompts = make_prompts(llm.config.model_config.vocab_size)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        ids = [llm._add_request({"prompt_token_ids": p}, params) for p in prompts]
        scheduler = llm.engine_core.scheduler
        preempted = 0
        for _ in range(8):
            llm.output_processor.process_outputs(llm.engine_core.step())
            for request in scheduler.running[::3]:
                scheduler._preempt_request(request)
                scheduler.running.remove(request)
                preempted += 1
        assert preempted >= 4 and scheduler.num_preemptions == preempted
        outputs = llm._run_engine(ids, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference(path, prompts)
        assert_pool_full(llm)


def test_mamba_runs_on_v1_and_names_what_v2_lacks(tiny_model, monkeypatch, caplog) -> None:
    path = tiny_model("mamba")
    monkeypatch.delenv("PDSERVE_USE_V2_MODEL_RUNNER", raising=False)
    with caplog.at_level(logging.INFO):
        config = EngineConfig.from_engine_args(model=path)
    assert config.use_v2_model_runner is False
    assert "V1 model runner instead" not in caplog.text
    assert "Prefix caching is off for MambaForCausalLM" in caplog.text
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(
        ValueError, match="^Model Runner V2 does not yet support: hybrid/mamba models$"
    ):
        EngineConfig.from_engine_args(model=path)


def test_a_qwen3_5_step_holds_a_whole_deltanet_chunk(tiny_model, v1) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens=40 is below 64: Qwen3_5"):
        EngineConfig.from_engine_args(
            model=tiny_model("qwen3_5"), max_num_batched_tokens=40, max_num_seqs=8
        )


def test_state_models_refuse_pp_and_indivisible_tp_by_name(tiny_model, v1) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size must be 1"):
        EngineConfig.from_engine_args(model=tiny_model("mamba"), pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="does not divide the model's intermediate_size=128"):
        EngineConfig.from_engine_args(model=tiny_model("mamba"), tensor_parallel_size=3)
