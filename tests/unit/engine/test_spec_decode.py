"""Speculative decoding (n-gram, Model Runner V1): greedy output with speculation is greedy
output without it, token for token (HF's, tiny models in float32), in batches, with chunked
prefill, prefix caching and preemption; drafts are proposed and accepted; pools full after;
speculative_config's keys checked by name and the runners' rule (vLLM's: V2 runs EAGLE,
EAGLE-3 and MTP) applied."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import generate_latest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.config.speculative import SpeculativeConfig
from pdserve.metrics import EngineMetrics
from pdserve.sampling_params import StructuredOutputsParams
from pdserve.scheduler import scheduler as scheduler_module
from pdserve.scheduler.drafts import Drafter, propose_ngram
from pdserve.scheduler.output import DRAFT_PLACEHOLDER
from pdserve.scheduler.stats import SchedulerStats, SpecDecodingStats
from tests.unit.engine.test_correctness import MAX_TOKENS, assert_pool_full, reference, run
from tests.utils.tiny_models import make_tiny_model

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}

# Async scheduling overlaps steps only with the workers in their own processes; chunked and
# preempting too, so that a step in flight meets both.
ASYNC = {
    "distributed_executor_backend": "mp",
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "num_gpu_blocks_override": 12,
}


def copy_heavy_prompts(vocab_size: int) -> list[list[int]]:
    """Random texts, each repeated: the n-gram drafter finds its suffix earlier on."""
    rng = random.Random(5)
    texts = [[rng.randrange(4, vocab_size) for _ in range(n)] for n in (6, 11, 20, 33)]
    return [t * 3 for t in texts] + [[rng.randrange(4, vocab_size) for _ in range(9)]]


@pytest.fixture
def v1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "0")


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"max_num_batched_tokens": 16, "max_num_seqs": 4},  # chunked, drafts cut to the budget
        {"num_gpu_blocks_override": 12, "max_num_seqs": 5},  # preemption
        ASYNC,
    ],
    ids=["batched", "chunked", "preempting", "async"],
)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_drafts_is_greedy(tiny_model, v1, monkeypatch, engine, method) -> None:
    """The draft model is the target itself (a mechanics check): its guesses are the target's
    greedy tokens, so every draft is accepted, its KV kept right through chunks, preemption
    and rollback. Async: the runner fills the draft slots of requests with a step in flight."""
    path = tiny_model("llama")
    spec = NGRAM if method == "ngram" else draft_model(path)
    filled = record_filled_drafts(monkeypatch)
    with LLM(
        model=path, dtype="float32", max_model_len=256, speculative_config=spec, **engine
    ) as llm:
        prompts = copy_heavy_prompts(llm.config.model_config.vocab_size)
        assert run(llm, prompts) == reference(path, prompts)
        stats = llm.engine_core.scheduler.spec_stats
        assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
        if method == "draft_model":
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        # Async n-gram slots that find no match count as misses: then drafts are 1-token probes.
        assert len(stats.accepted_per_position) == 3 or (engine is ASYNC and method == "ngram")
        assert bool(filled) is (engine is ASYNC)
        if engine is ASYNC:
            assert llm.engine_core.scheduler.num_preemptions > 0
            assert sum(filled) > 0  # guesses went into placeholder slots
        assert_pool_full(llm)


def record_filled_drafts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many placeholder slots the runner filled, per request and step, as the scheduler
    receives them."""
    filled: list[int] = []
    roll_back = scheduler_module.roll_back_rejected

    def recording(spec, model_runner_output, *args):  # type: ignore[no-untyped-def]
        filled.extend((model_runner_output.num_filled_drafts or {}).values())
        return roll_back(spec, model_runner_output, *args)

    monkeypatch.setattr(scheduler_module, "roll_back_rejected", recording)
    return filled


def test_drafts_and_their_grammar_rows_reach_tp_workers(tiny_model, v1) -> None:
    """Under TP 2 (worker processes): the scheduler's drafts and the bitmask rows of a grammar's
    draft positions cross the wire to every rank, the draft model's KV is each rank's share."""
    path = tiny_model("llama")
    with LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        speculative_config=draft_model(path),
        tensor_parallel_size=2,
    ) as llm:
        prompts = copy_heavy_prompts(llm.config.model_config.vocab_size)
        assert run(llm, prompts) == reference(path, prompts)
        stats = llm.engine_core.scheduler.spec_stats
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        choices = ["yes", "no", "it depends"]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=16,
            structured_outputs=StructuredOutputsParams(choice=choices),
        )
        (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        assert out.outputs[0].text in choices
        assert_pool_full(llm)


def draft_model(path: str) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 3}


def test_another_draft_model_changes_acceptance_not_tokens(tiny_model, v1, tmp_path) -> None:
    """A draft of one layer and other weights: its guesses are mostly rejected (both models
    are random), the tokens are the target's greedy ones; its layers' KV share the blocks."""
    path = tiny_model("llama")
    draft = make_tiny_model("llama", tmp_path / "draft", seed=1, num_hidden_layers=1)
    with LLM(
        model=path, dtype="float32", max_model_len=256, speculative_config=draft_model(str(draft))
    ) as llm:
        prompts = copy_heavy_prompts(llm.config.model_config.vocab_size)
        assert run(llm, prompts) == reference(path, prompts)
        stats = llm.engine_core.scheduler.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
        runner = llm.engine_core.executor.worker.model_runner
        assert runner.kv_cache.shape[1] == 2 + 1  # the target's layers, then the draft's
        assert_pool_full(llm)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vocab_size": 600}, "the draft model's vocabulary \\(600 tokens\\) differs from "),
        ({"num_key_value_heads": 4}, "the draft model's KV layers \\(4 heads of 16\\) differ"),
    ],
)
def test_a_draft_model_the_target_cannot_use_is_named(
    tiny_model, v1, tmp_path, overrides, message
) -> None:
    draft = make_tiny_model("llama", tmp_path / "draft", **overrides)
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_engine_args(
            model=tiny_model("llama"), speculative_config=draft_model(str(draft))
        )


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(tiny_model, v1) -> None:
    """Each prompt stops at the first occurrence of a token of its greedy output, reached
    inside a run of drafts or not: the tokens after it are dropped."""
    path = tiny_model("llama")
    with LLM(model=path, dtype="float32", max_model_len=256, speculative_config=NGRAM) as llm:
        prompts = copy_heavy_prompts(llm.config.model_config.vocab_size)
        expected = reference(path, prompts)
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                stop_token_ids=[tokens[9]],
            )
            for tokens in expected
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for output, tokens in zip(outputs, expected, strict=True):
            assert output.outputs[0].token_ids == tokens[: tokens.index(tokens[9]) + 1]
        assert llm.engine_core.scheduler.spec_stats.num_accepted_tokens > 0
        assert_pool_full(llm)


def test_drafts_with_penalties_min_tokens_and_logprobs_change_nothing(tiny_model, v1) -> None:
    """Greedy requests with penalties, min_tokens and logprobs draft too: their tokens and
    logprobs are those of decoding without speculation. Sampled requests draft and finish."""
    path = tiny_model("llama")
    common = {"max_tokens": MAX_TOKENS}
    kinds = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, **common),
        SamplingParams(temperature=0.0, min_tokens=20, logprobs=2, **common),
        SamplingParams(temperature=0.0, presence_penalty=0.5, logprobs=0, **common),
        SamplingParams(temperature=0.8, top_k=20, seed=3, logprobs=1, **common),
    ]

    def generate(**spec) -> list:
        with LLM(model=path, dtype="float32", max_model_len=256, **spec) as llm:
            prompts = copy_heavy_prompts(llm.config.model_config.vocab_size)
            params = [kinds[i % len(kinds)] for i in range(len(prompts))]
            inputs = [{"prompt_token_ids": p} for p in prompts]
            outputs = [o.outputs[0] for o in llm.generate(inputs, params, use_tqdm=False)]
            if spec:
                assert llm.engine_core.scheduler.spec_stats.num_accepted_tokens > 0
            assert_pool_full(llm)
        return outputs

    with_drafts, without = generate(speculative_config=NGRAM), generate()
    for i, (got, want) in enumerate(zip(with_drafts, without, strict=True)):
        params = kinds[i % len(kinds)]
        if params.logprobs is not None:
            assert got.logprobs is not None and len(got.logprobs) == len(got.token_ids)
        if params.temperature > 0:
            continue
        assert got.token_ids == want.token_ids
        for got_lp, want_lp in zip(got.logprobs or [], want.logprobs or [], strict=True):
            assert got_lp.keys() == want_lp.keys()
            for token, entry in got_lp.items():
                assert entry.rank == want_lp[token].rank
                assert entry.logprob == pytest.approx(want_lp[token].logprob, abs=1e-5)


def test_drafts_that_keep_missing_pause_drafting() -> None:
    """Consecutive misses pause a request's drafting up to 1, 2, 4 .. 64 steps, to the shared
    clock's next multiple of the pause, which ends on a probe of one draft; a hit ends it."""
    request = SimpleNamespace(
        request_id="r",
        draft_resume_step=0,
        draft_misses=0,
        spec_token_ids=[],
        max_num_tokens=1000,
        num_tokens=10,
        num_prompt_tokens=5,
        num_output_placeholders=1,  # a step in flight: slots, not looked up
        sampling_params=SamplingParams(),
        structured_output=None,
    )
    drafter = Drafter(SpeculativeConfig("ngram", 3))
    resumes = []
    for _ in range(9):
        drafter.step += 5  # steps that did not draft for it
        drafter.back_off(request, 0)
        resumes.append(request.draft_resume_step)
        while drafter.step < request.draft_resume_step:
            assert drafter.propose(request, 8, 0) == []  # paused
            drafter.end_step()
        assert drafter.propose(request, 8, 0) == [DRAFT_PLACEHOLDER]  # the probe
    assert resumes == [6, 12, 20, 32, 48, 64, 128, 192, 256]
    drafter.back_off(request, 1)
    assert drafter.propose(request, 8, 0) == [DRAFT_PLACEHOLDER] * 3
    drafter.back_off(request, 0)
    assert request.draft_resume_step == drafter.step + 1


def test_ngram_proposals() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # The longest suffix (3 tokens) last seen at 4: what followed it there.
    assert propose_ngram(tokens, 1, 3, 2) == [7, 8]
    assert propose_ngram(tokens, 1, 3, 9) == [7, 8, 1, 2, 3]
    assert propose_ngram([5, 6, 7], 1, 3, 2) == []
    assert propose_ngram([4, 5, 4], 2, 2, 2) == []  # the 1-token match is below the minimum
    assert propose_ngram([4, 5, 4], 1, 2, 2) == [5, 4]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_speculative_tokens": 2}, "speculative_config.method is required"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "num_speculative_tokens must be a positive integer, got None"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_min=4 exceeds prompt_lookup_max=3",
        ),  # fmt: skip
        (
            {"method": "eagle", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            "prompt_lookup_max is for method 'ngram' only",
        ),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.model is required"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys \\['k'\\]"),
        (
            {"method": "eagle3", "num_speculative_tokens": 2, "model": "x"},
            "the EAGLE-3 and MTP drafters are not built yet",
        ),
    ],
)
def test_bad_speculative_config_is_named(tiny_model, v1, config, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_engine_args(model=tiny_model("llama"), speculative_config=config)


def test_ngram_defaults_and_runner_rule(tiny_model, monkeypatch, caplog) -> None:
    """vLLM's defaults (both lookup ends 5; "[ngram]" as the model names the method); a model
    that would get V2 falls back to V1 naming the method, forced V2 refuses it."""
    path = tiny_model("llama")
    monkeypatch.delenv("PDSERVE_USE_V2_MODEL_RUNNER", raising=False)
    with caplog.at_level(logging.WARNING):
        config = EngineConfig.from_engine_args(
            model=path, speculative_config={"model": "[ngram]", "num_speculative_tokens": 2}
        )
    spec = config.speculative_config
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 5, 5)
    assert config.use_v2_model_runner is False
    assert config.scheduler_config.async_scheduling is True
    assert caplog.text.count("speculative method 'ngram'; using the V1 model runner") == 1
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(
        ValueError, match="^Model Runner V2 does not yet support: speculative method 'ngram'$"
    ):
        EngineConfig.from_engine_args(model=path, speculative_config=NGRAM)


@pytest.mark.parametrize(
    ("arch", "args", "message"),
    [
        ("mamba", {}, "its recurrent state cannot take rejected drafts back"),
    ],
)
def test_what_speculation_does_not_run_with_yet_is_refused(tiny_model, v1, arch, args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_engine_args(model=tiny_model(arch), speculative_config=NGRAM, **args)


def test_spec_decode_counters_on_metrics() -> None:
    """vLLM's four counters under pdserve's prefix, from the scheduler's cumulative stats (the
    exposition adds _total); each report adds its difference from the last."""
    metrics = EngineMetrics("m")
    spec = SpecDecodingStats()
    for num_drafts, num_accepted in ((3, 2), (3, 0), (2, 2)):
        spec.observe(num_drafts, num_accepted)
        snapshot = msgspec.convert(msgspec.to_builtins(spec), SpecDecodingStats)  # as sent
        metrics.record_scheduler_stats(
            SchedulerStats(0, 0, 0.0, 0, 0, 0, 1, 1, spec_decoding=snapshot)
        )
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'pdserve:spec_decode_num_draft_tokens_total{model_name="m"} 8.0' in text
    assert 'pdserve:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    per_pos = "pdserve:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{model_name="m",position="0"}} 2.0' in text
    assert f'{per_pos}{{model_name="m",position="1"}} 2.0' in text
