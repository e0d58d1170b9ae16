"""The rejection sampler (speculative decoding's verification): every emitted token of a
sampled request is distributed as the target's distribution at its position (Leviathan et
al.), drafts accepted or not; greedy rows accept exactly the drafts equal to the argmax; a
request's rows see the drafts before them as output (penalties, min_tokens)."""

from __future__ import annotations

import torch

from pdserve.runners.rejection_sampler import DraftRows, rejection_sample
from pdserve.runners.sampler import SamplingRow
from pdserve.sampling_params import SamplingParams
from tests.utils.sampling import chi_square_p_value, make_md, reference_probs

LOGITS = torch.tensor([0.7, -1.0, 2.0, 0.3, 1.2, -2.0, 1.5, 0.0, -0.5, 1.0, -1.5, 0.5])
# The target's rows after 0, 1 and 2 drafts: a different distribution at each position.
TARGET = torch.stack([LOGITS, LOGITS.roll(3), LOGITS.flip(0)])
DRAFTS = [2, 9]  # likely under row 0, less so under row 1: both outcomes are frequent
NUM_REQUESTS = 30_000


def draft_rows(num_requests: int, drafts: list[int]) -> DraftRows:
    req_ids = [str(i) for i in range(num_requests)]
    ends = [(i + 1) * (len(drafts) + 1) for i in range(num_requests)]
    return DraftRows.build({r: drafts for r in req_ids}, req_ids, ends)


def test_emitted_tokens_follow_the_target_at_every_position() -> None:
    torch.manual_seed(7)
    params = SamplingParams(temperature=0.9, top_k=10)
    rows = draft_rows(NUM_REQUESTS, DRAFTS)
    assert rows.logits_indices[:6].tolist() == [0, 1, 2, 3, 4, 5]
    logits = TARGET.repeat(NUM_REQUESTS, 1)
    tokens, chosen = rejection_sample(logits, make_md([params] * len(logits)), rows)
    assert all(1 <= len(t) <= 3 for t in tokens)
    assert chosen.shape == (len(logits),)
    vocab_size = LOGITS.numel()
    prefix: list[int] = []
    for position in range(3):
        # The token at `position` of the requests whose drafts before it were all accepted.
        reached = [t[position] for t in tokens if t[:position] == prefix]
        counts = torch.bincount(torch.tensor(reached), minlength=vocab_size)
        probs = reference_probs(TARGET[position], params)
        assert counts[probs == 0].sum() == 0
        assert chi_square_p_value(counts, probs) > 1e-3, (position, counts, probs)
        prefix = DRAFTS[: position + 1]


def test_greedy_rows_accept_while_the_draft_is_the_argmax() -> None:
    greedy = SamplingParams(temperature=0.0)
    argmaxes = TARGET.argmax(dim=-1).tolist()  # [2, 5, 9]
    cases = [
        ([2, 5], [2, 5, 9]),  # both accepted: row 2's argmax follows
        ([2, 4], [2, 5]),  # the second rejected: row 1's argmax replaces it
        ([0, 5], [2]),  # the first rejected
    ]
    for drafts, expected in cases:
        rows = draft_rows(1, drafts)
        tokens, chosen = rejection_sample(TARGET.clone(), make_md([greedy] * 3), rows)
        assert tokens == [expected], (drafts, argmaxes)
        assert chosen.tolist()[: len(expected)] == expected


def test_a_requests_rows_see_its_earlier_drafts_as_output() -> None:
    """Row j's sampler inputs: the request's output with drafts 0..j-1 appended (a
    repetition penalty then turns draft 0 away from row 1's argmax)."""
    rows = draft_rows(1, [2, 2])
    base = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [1], [7])
    expanded = rows.expand([base])
    assert [r.output_token_ids for r in expanded] == [[7], [7, 2], [7, 2, 2]]
    logits = LOGITS.repeat(3, 1)
    md = make_md(
        [r.params for r in expanded],
        [r.output_token_ids for r in expanded],
        [r.prompt_token_ids for r in expanded],
    )
    tokens, _ = rejection_sample(logits, md, rows)
    # Row 0 takes 2 (nothing penalised yet); row 1 has 2 penalised: 6 (logit 1.5) instead.
    assert tokens == [[2, 6]]
