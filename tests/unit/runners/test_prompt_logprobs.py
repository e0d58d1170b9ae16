"""Prompt logprobs in the runner: the computation against torch's log_softmax on random logits,
chunk by chunk, and what the tracker owes whom."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import sampling
from pdserve.runners import prompt_logprobs
from pdserve.runners.prompt_logprobs import (
    PromptLogprobsTracker,
    compute_prompt_logprobs,
)
from pdserve.sampling_params import SamplingParams

VOCAB = 300


def reference(logits: torch.Tensor, target: int, k: int) -> tuple[float, int, list[int]]:
    """The target's logprob and rank (tokens at least as likely), and the k most likely ids."""
    logprobs = logits.double().log_softmax(dim=-1)
    rank = int((logprobs >= logprobs[target]).sum())
    return float(logprobs[target]), rank, logprobs.topk(k).indices.tolist()


@pytest.mark.parametrize(
    "topk_logprobs",
    [sampling.topk_logprobs_torch, sampling.topk_logprobs_triton],
    ids=["torch", "triton"],
)
def test_chunks_match_log_softmax(topk_logprobs, monkeypatch) -> None:
    # Slices of 3 rows: chunks straddle them.
    monkeypatch.setattr(prompt_logprobs, "MAX_ROWS", 3)
    torch.manual_seed(0)
    prompts = {r: torch.randint(0, VOCAB, (n,)).tolist() for r, n in (("a", 9), ("b", 5))}
    widths = {"a": 4, "b": 0}
    tracker = PromptLogprobsTracker()
    for req_id, prompt in prompts.items():
        tracker.add_request(req_id, SamplingParams(prompt_logprobs=widths[req_id]), prompt, 0)
    # Step 1: a's positions 0-3 and b's whole prompt after a decode token; step 2: a's rest.
    steps = [[("a", 0, 4, 1), ("b", 0, 5, 5)], [("a", 4, 5, 0)]]
    hidden_of_step = []
    for scheduled in steps:
        hidden = torch.randn(12, VOCAB) * 3  # the stub head: logits = hidden states
        hidden_of_step.append(hidden)
        chunks = tracker.chunks(scheduled)
        for chunk, rows in zip(
            chunks, compute_prompt_logprobs(hidden, chunks, lambda h: h, topk_logprobs)
        ):
            tracker.record(chunk, rows)
    done = tracker.pop_sampled(["a", "b"])
    assert done is not None and done.keys() == {"a", "b"} and not tracker.pending
    for req_id, prompt in prompts.items():
        lp, k = done[req_id], widths[req_id]
        assert len(lp.sampled_token_ranks) == len(prompt) - 1
        for pos in range(len(prompt) - 1):
            step, (_, start, _, flat_start) = next(
                (i, s)
                for i, scheduled in enumerate(steps)
                for s in scheduled
                if s[0] == req_id and s[1] <= pos < s[1] + s[2]
            )
            logits = hidden_of_step[step][flat_start + pos - start]
            want_logprob, want_rank, want_top = reference(logits, prompt[pos + 1], k)
            assert lp.logprob_token_ids[pos][0] == prompt[pos + 1]
            assert lp.sampled_token_ranks[pos] == want_rank
            assert lp.logprob_token_ids[pos][1:] == want_top
            assert lp.logprobs[pos][0] == pytest.approx(want_logprob, abs=1e-5)
            ref = logits.double().log_softmax(dim=-1)[want_top].tolist()
            assert lp.logprobs[pos][1:] == pytest.approx(ref, abs=1e-5)


def test_bf16_logits_are_reduced_in_fp32() -> None:
    torch.manual_seed(1)
    hidden = (torch.randn(4, VOCAB) * 8).bfloat16()
    tracker = PromptLogprobsTracker()
    prompt = [7, 8, 9, 10, 11]
    tracker.add_request("r", SamplingParams(prompt_logprobs=2), prompt, 0)
    chunks = tracker.chunks([("r", 0, 4, 0)])
    (rows,) = compute_prompt_logprobs(hidden, chunks, lambda h: h, sampling.topk_logprobs_torch)
    want = hidden.float().log_softmax(dim=-1)
    got = [row[0] for row in rows.logprobs]
    assert got == pytest.approx([float(want[i, prompt[i + 1]]) for i in range(4)], abs=1e-6)


def test_what_is_owed() -> None:
    tracker = PromptLogprobsTracker()
    tracker.add_request("plain", SamplingParams(), [1, 2, 3], 0)
    tracker.add_request("resumed", SamplingParams(prompt_logprobs=1), [1, 2, 3], 2)
    tracker.add_request("one", SamplingParams(prompt_logprobs=1), [5], 0)
    tracker.add_request("loaded", SamplingParams(prompt_logprobs=1), [1, 2, 3, 4], 0)
    # Nothing for requests that did not ask, or had them with their first token already.
    assert tracker.pending.keys() == {"one", "loaded"}
    # A one-token prompt has no position to score: its table is empty. A prompt whose
    # computation starts past position 0 (its KV loaded) gets none.
    assert tracker.chunks([("one", 0, 1, 0), ("loaded", 2, 2, 1)]) == []
    done = tracker.pop_sampled(["one", "loaded", "other"])
    assert done is not None and done.keys() == {"one"}
    assert done["one"].sampled_token_ranks == []
    assert not tracker.pending


def test_a_recomputed_prompt_starts_anew() -> None:
    """Preempted mid-prompt, a request is computed again from position 0."""
    tracker = PromptLogprobsTracker()
    prompt = [3, 4, 5, 6, 7]
    tracker.add_request("r", SamplingParams(prompt_logprobs=0), prompt, 0)
    hidden = torch.randn(4, VOCAB)
    for scheduled in ([("r", 0, 2, 0)], [("r", 0, 4, 0)]):
        chunks = tracker.chunks(scheduled)
        (rows,) = compute_prompt_logprobs(hidden, chunks, lambda h: h, sampling.topk_logprobs_torch)
        tracker.record(chunks[0], rows)
    done = tracker.pop_sampled(["r"])
    assert done is not None
    assert [ids[0] for ids in done["r"].logprob_token_ids] == prompt[1:]
