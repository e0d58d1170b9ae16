"""Structured outputs (xgrammar) on one engine: greedy tokens equal HF's under the same
grammar masked by xgrammar's own kernel, for each constraint kind, both runners, async and
sync scheduling; bad constraints are refused naming the field; the pool ends full."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.engine.messages import EngineCoreRequest
from pdserve.sampling_params import StructuredOutputsParams
from pdserve.structured_output.grammar import compile_grammar
from tests.unit.engine.test_eagle import eagle
from tests.utils.tiny_models import EOS_TOKEN_ID, hf_greedy_constrained, make_tiny_eagle_head

MAX_TOKENS = 40
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "count": {"type": "integer"},
    },
    "required": ["answer", "count"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "json_compact": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{2,4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "it depends"]),
    "grammar": StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
}
PROMPTS = [[5, 17, 99, 240, 31], [400, 12, 7], list(range(40, 75))]
RUNNERS = {"v1": "0", "v2": "1"}

_compilers: dict[str, xgr.GrammarCompiler] = {}
_references: dict[tuple, list[int]] = {}


def reference(path: str, prompt: list[int], params: StructuredOutputsParams) -> list[int]:
    key = (path, tuple(prompt), repr(params))
    if key not in _references:
        if path not in _compilers:
            info = xgr.TokenizerInfo.from_huggingface(
                AutoTokenizer.from_pretrained(path), vocab_size=512, stop_token_ids=[EOS_TOKEN_ID]
            )
            _compilers[path] = xgr.GrammarCompiler(info)
        compiled = compile_grammar(_compilers[path], params)
        _references[key] = hf_greedy_constrained(path, prompt, compiled, MAX_TOKENS)
    return _references[key]


def generate(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_full(llm: LLM) -> None:
    core = llm.engine_core
    assert core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == core.num_blocks - 1
    assert not core.waiting_for_grammar and core.scheduler.num_structured_reqs == 0


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize(
    ("runner", "async_scheduling", "spec"),
    [
        ("v1", None, None),
        ("v1", False, None),
        ("v2", None, None),
        ("v2", False, None),
        ("v1", None, NGRAM),  # each draft position masked as if the drafts before it were out
        ("v2", None, "eagle"),  # a random head: its guesses cut to what the grammar accepts
    ],
    ids=["v1-async", "v1-sync", "v2-async", "v2-sync", "v1-ngram", "v2-eagle"],
)
def test_greedy_matches_hf_under_each_constraint(
    tiny_model, tmp_path, monkeypatch, runner, async_scheduling, spec
):
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[runner])
    path = tiny_model("llama")
    if spec == "eagle":
        spec = eagle(make_tiny_eagle_head(tmp_path / "eagle"))
    with LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        async_scheduling=async_scheduling,
        speculative_config=spec,
    ) as llm:
        tokenizer = llm.get_tokenizer()
        for kind, constraint in CONSTRAINTS.items():
            # One constrained and one free request per prompt, in one batch.
            params = [
                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=c)
                for c in (constraint, None, constraint)
            ]
            outputs = generate(llm, params)
            for prompt, out in zip(PROMPTS[::2], outputs[::2]):
                assert out == reference(path, prompt, constraint), kind
            text = tokenizer.decode(outputs[0], skip_special_tokens=True)
            if outputs[0][-1] == EOS_TOKEN_ID:  # the grammar ended
                if kind == "regex":
                    assert re.fullmatch(constraint.regex, text)
                elif kind == "choice":
                    assert text in constraint.choice
                elif kind.startswith("json"):
                    json.loads(text)
            assert_pool_full(llm)
        if spec is NGRAM:
            assert llm.engine_core.scheduler.spec_stats.num_accepted_tokens > 0
        elif spec is not None:
            assert llm.engine_core.scheduler.spec_stats.num_drafts > 0


def test_terminating_constraints_end_with_a_match(tiny_model):
    """A choice and a bounded regex always end within the budget: the text matches."""
    with LLM(model=tiny_model("llama"), dtype="float32", max_model_len=256) as llm:
        tokenizer = llm.get_tokenizer()
        for constraint, ok in [
            (StructuredOutputsParams(choice=["alpha", "beta"]), {"alpha", "beta"}.__contains__),
            (
                StructuredOutputsParams(regex=r"(red|green|blue) [0-9]"),
                re.compile(r"(red|green|blue) [0-9]").fullmatch,
            ),
        ]:
            params = SamplingParams(
                temperature=0.8, seed=3, max_tokens=30, structured_outputs=constraint
            )
            for out in generate(llm, [params] * len(PROMPTS)):
                assert out[-1] == EOS_TOKEN_ID
                assert ok(tokenizer.decode(out, skip_special_tokens=True))
        assert_pool_full(llm)


@pytest.mark.parametrize(
    "params, message",
    [
        (
            dict(json={"type": "object", "properties": 5}),
            "structured_outputs.json is invalid: properties must be an object",
        ),
        (dict(regex="[a-"), "structured_outputs.regex is invalid: Regex parsing error"),
        (
            dict(grammar="root ::= b"),
            'structured_outputs.grammar is invalid: EBNF parser error at line 1, column 10: Rule "b" is not defined',
        ),
        (dict(json="[1]"), "structured_outputs.json is invalid: a JSON schema is an object"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(tiny_model, params, message):
    with LLM(model=tiny_model("llama"), dtype="float32", max_model_len=256) as llm:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(**params)))
        assert_pool_full(llm)


def test_an_id_in_use_is_refused_on_arrival(tiny_model):
    """A constrained request under the id of one the scheduler holds, or a free one under the
    id of one waiting for its grammar, is refused when it arrives: the scheduler refusing it
    once its grammar compiled ended the engine (the proxy's X-Request-Id fuzzed, issue 27)."""
    with LLM(model=tiny_model("llama"), dtype="float32", max_model_len=256) as llm:
        core = llm.engine_core

        def request(request_id: str, constraint: StructuredOutputsParams | None):
            params = SamplingParams(max_tokens=4, structured_outputs=constraint)
            return EngineCoreRequest(request_id, PROMPTS[0], params, EOS_TOKEN_ID, 0.0)

        for first, second in [(None, CONSTRAINTS["choice"]), (CONSTRAINTS["choice"], None)]:
            core.add_request(request("x", first))
            with pytest.raises(ValueError, match="'x' is already in use"):
                core.add_request(request("x", second))
            while core.has_work():
                core.step()
            assert_pool_full(llm)


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(json="{}", regex="a"), dict(choice=[]), dict(choice=["a", ""])]
)
def test_one_constraint_per_request(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)
