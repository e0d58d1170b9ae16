"""SamplingParams.prompt_logprobs through the engine, against HF transformers' logits, for both
runners: chunked prefill gives what one chunk gives, and neither prefix caching nor preemption
cuts them short."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.outputs import RequestOutput
from tests.unit.engine.test_correctness import RUNNERS, assert_pool_full, make_llm
from tests.utils.tiny_models import hf_logits, load_hf_model

K = 3
# One token (no position to score), under a block, two blocks and a bit: chunks of 16 split them.
PROMPTS = [[7], [5, 17, 33, 99, 200, 7, 8, 9, 300], [(i * 37) % 500 + 3 for i in range(40)]]


def generate(
    llm: LLM, prompts: list[list[int]], max_tokens: int = 3, **params: int | None
) -> list[RequestOutput]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def table(out: RequestOutput) -> list[list[tuple[int, int, float]]]:
    """Per position: (token id, rank, logprob) of each entry, in their order."""
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return [
        [(tid, lp.rank, lp.logprob) for tid, lp in entry.items()]
        for entry in out.prompt_logprobs[1:]
    ]


def assert_same(got: RequestOutput, want: RequestOutput) -> None:
    got_table, want_table = table(got), table(want)
    assert [[e[:2] for e in row] for row in got_table] == [
        [e[:2] for e in row] for row in want_table
    ]
    for row, want_row in zip(got_table, want_table):
        assert [e[2] for e in row] == pytest.approx([e[2] for e in want_row], abs=1e-5)


@pytest.fixture(params=list(RUNNERS))
def runner(request, monkeypatch) -> str:
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[request.param])
    return request.param


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model) -> list[torch.Tensor]:
    model = load_hf_model(Path(tiny_model("llama")))
    return [hf_logits(model, p).log_softmax(dim=-1) for p in PROMPTS]


def test_prompt_logprobs_match_hf_chunked_and_cached(tiny_model, runner, hf_logprobs):
    path = tiny_model("llama")
    with make_llm(path, runner) as llm:
        whole = generate(llm, PROMPTS, prompt_logprobs=K)
        plain = generate(llm, PROMPTS)
        # Every prompt's blocks are cached now; a request asking prompt logprobs takes no hit.
        again = generate(llm, PROMPTS, prompt_logprobs=K)
        assert_pool_full(llm)
    assert [o.num_cached_tokens for o in plain] == [0, 0, 32]
    assert [o.num_cached_tokens for o in again] == [0, 0, 0]
    for out, out_again, ref_out, prompt, ref in zip(whole, again, plain, PROMPTS, hf_logprobs):
        assert ref_out.prompt_logprobs is None
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids
        assert_same(out_again, out)
        rows = table(out)
        assert len(rows) == len(prompt) - 1
        for pos, row in enumerate(rows):
            logprobs, target = ref[pos], prompt[pos + 1]
            top = logprobs.topk(K).indices.tolist()
            (tid, rank, value), *rest = row
            assert tid == target
            assert rank == int((logprobs >= logprobs[target]).sum())
            assert value == pytest.approx(float(logprobs[target]), abs=1e-4)
            # The prompt token first, then the top K (it is among them once, if it is one).
            assert [t for t, _, _ in rest] == [t for t in top if t != target]
            for t, r, v in rest:
                assert r == top.index(t) + 1
                assert v == pytest.approx(float(logprobs[t]), abs=1e-4)
    # Chunks of 16 tokens, a few requests at a time: the same tables.
    with make_llm(path, runner, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        chunked = generate(llm, PROMPTS + [PROMPTS[2]], prompt_logprobs=K)
        assert_pool_full(llm)
    for got, want in zip(chunked, whole + [whole[2]]):
        assert_same(got, want)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # 7 usable blocks cannot hold three 40-token prompts growing by 24 tokens each: preempted
    # requests are computed again, their prompt logprobs returned once, as they were.
    with make_llm(path, runner, num_gpu_blocks_override=8) as llm:
        preempted = generate(llm, [PROMPTS[2]] * 3, max_tokens=24, prompt_logprobs=K)
        assert llm.engine_core.scheduler.make_stats().num_preemptions > 0
        assert_pool_full(llm)
    for got in preempted:
        assert_same(got, whole[2])
