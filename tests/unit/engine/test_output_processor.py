"""The output processor's kinds of output: a stream's step carries only what is new, and the
deltas join to what a non-streaming caller gets."""

from __future__ import annotations

import pytest

from pdserve.engine.output_processor import OutputProcessor
from pdserve.outputs import EngineCoreOutput, Logprob, LogprobsLists, RequestOutputKind
from pdserve.request import FinishReason
from pdserve.sampling_params import SamplingParams
from tests.utils.tiny_models import make_tokenizer

TEXT = "The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(512)


def run(tokenizer, kind: RequestOutputKind, params: SamplingParams, n_steps: int | None = None):
    """Feed TEXT's tokens one per step; returns every update and the ids it asked to abort."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1, 5, 6], params, kind)
    tokens = tokenizer.encode(TEXT)[:n_steps]
    updates, aborted = [], []
    for step, token in enumerate(tokens):
        last = step == len(tokens) - 1
        out = EngineCoreOutput(
            "r",
            [token],
            LogprobsLists([[token]], [[-0.5]], [1]) if params.logprobs is not None else None,
            finish_reason=int(FinishReason.LENGTH) if last else None,
        )
        step_updates, to_abort = processor.process_outputs([out])
        updates += step_updates
        aborted += to_abort
        if to_abort:
            break
    assert "r" not in processor.requests  # forgotten once finished
    return updates, aborted


def join(updates) -> tuple[str, list[int], int]:
    outputs = [c for u in updates for c in u.output.outputs]
    return "".join(c.text for c in outputs), [t for c in outputs for t in c.token_ids], len(outputs)


def test_a_delta_holds_only_the_steps_new_tokens(tokenizer) -> None:
    params = SamplingParams(max_tokens=100, logprobs=0)
    updates, _ = run(tokenizer, RequestOutputKind.DELTA, params)
    final, _ = run(tokenizer, RequestOutputKind.FINAL_ONLY, params)
    (final_output,) = [u.output for u in final if u.output is not None]
    completion = final_output.outputs[0]
    for u in updates:
        (c,) = u.output.outputs
        assert len(c.token_ids) == len(c.logprobs) == 1  # not the history so far
        assert u.num_new_tokens == 1
    text, token_ids, _ = join(updates)
    assert text == completion.text == tokenizer.decode(completion.token_ids)
    assert token_ids == completion.token_ids
    assert updates[-1].finished and updates[-1].output.outputs[0].finish_reason == "length"
    assert not any(u.finished for u in updates[:-1])


def test_final_only_gives_one_cumulative_output(tokenizer) -> None:
    updates, _ = run(tokenizer, RequestOutputKind.FINAL_ONLY, SamplingParams(max_tokens=100))
    assert [u.output is not None for u in updates] == [False] * (len(updates) - 1) + [True]
    assert updates[-1].finish_reasons == ["length"]
    assert updates[-1].output.outputs[0].text == TEXT


def test_cumulative_outputs_are_not_changed_by_later_steps(tokenizer) -> None:
    updates, _ = run(tokenizer, RequestOutputKind.CUMULATIVE, SamplingParams(max_tokens=100))
    lengths = [len(u.output.outputs[0].token_ids) for u in updates]
    assert lengths == list(range(1, len(updates) + 1))


@pytest.mark.parametrize("include", [False, True])
def test_deltas_never_send_text_a_stop_string_cuts(tokenizer, include: bool) -> None:
    params = SamplingParams(max_tokens=100, stop=["Italy is"], include_stop_str_in_output=include)
    deltas, aborted = run(tokenizer, RequestOutputKind.DELTA, params)
    final, _ = run(tokenizer, RequestOutputKind.FINAL_ONLY, params)
    expected = "The capital of France is Paris. The capital of " + ("Italy is" if include else "")
    assert final[-1].output.outputs[0].text == expected
    assert join(deltas)[0] == expected
    assert aborted == ["r"]
    assert deltas[-1].output.outputs[0].finish_reason == "stop"


def test_n_sequences_deltas_carry_only_the_updated_ones(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    children = processor.add_request("r", None, [1], SamplingParams(n=2), RequestOutputKind.DELTA)
    (a, _), (b, _) = children
    updates, _ = processor.process_outputs([EngineCoreOutput(a, [7])])
    assert [c.index for c in updates[0].output.outputs] == [0]
    updates, _ = processor.process_outputs(
        [EngineCoreOutput(b, [8], finish_reason=int(FinishReason.LENGTH))]
    )
    assert [c.index for c in updates[0].output.outputs] == [1]
    assert updates[0].finish_reasons == ["length"] and not updates[0].finished


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_prompt_logprobs_come_with_the_first_token(tokenizer, kind: RequestOutputKind) -> None:
    """vLLM's form (None, then per position the prompt token and the top ones), in every
    output but a stream's later ones; with n > 1, once for the request."""
    processor = OutputProcessor(tokenizer)
    prompt = [1, 5, 6]
    params = SamplingParams(max_tokens=2, prompt_logprobs=1, n=2)
    children = processor.add_request("r", None, prompt, params, kind)
    rows = LogprobsLists([[5, 9], [6, 6]], [[-2.0, -0.5], [-0.25, -0.25]], [3, 1])
    outputs = []
    for step in range(2):
        step_outputs = [
            EngineCoreOutput(
                child_id,
                [7],
                prompt_logprobs=rows if step == 0 else None,
                finish_reason=int(FinishReason.LENGTH) if step == 1 else None,
            )
            for child_id, _ in children
        ]
        updates, _ = processor.process_outputs(step_outputs)
        outputs += [u.output for u in updates if u.output is not None]
    want = [
        None,
        {5: Logprob(-2.0, 3, tokenizer.decode([5])), 9: Logprob(-0.5, 1, tokenizer.decode([9]))},
        {6: Logprob(-0.25, 1, tokenizer.decode([6]))},
    ]
    if kind == RequestOutputKind.DELTA:
        assert [o.prompt_logprobs for o in outputs] == [want, None]
    else:
        assert all(o.prompt_logprobs == want for o in outputs) and outputs
