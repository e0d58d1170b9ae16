"""Speculative decoding's verification on the runner's side (greedy).

A request's step computes its next token and its k drafts. The greedy token after each of the
first k of those positions (the next token, then every draft but the last) checks the draft
that follows it: drafts are accepted while each equals it. At the first mismatch the greedy
token there is the step's last token; with every draft accepted, the token sampled after the
last draft is (vLLM's greedy rejection sampler). The logits are the same bits row by row as a
step of one token computes them (batch invariance), so the tokens are those of decoding
without speculation.
"""

from __future__ import annotations

import numpy as np


def draft_positions(
    spec_token_ids: dict[str, list[int]], rows: dict[str, int], ends: np.ndarray
) -> list[int]:
    """Token indices of the step whose greedy tokens check the drafts, request by request in
    `spec_token_ids` order: each request's last k + 1 scheduled tokens but the last
    (`rows`: each request's row; `ends`: the exclusive end of each row's tokens)."""
    indices: list[int] = []
    for req_id, drafts in spec_token_ids.items():
        end = int(ends[rows[req_id]])
        indices.extend(range(end - len(drafts) - 1, end - 1))
    return indices


def accept_drafts(
    spec_token_ids: dict[str, list[int]], verified: list[int], sampled: dict[str, list[int]]
) -> None:
    """Each drafting request's tokens in `sampled` (its token after the last draft) become its
    accepted drafts and the token after them."""
    offset = 0
    for req_id, drafts in spec_token_ids.items():
        greedy = verified[offset : offset + len(drafts)]
        offset += len(drafts)
        accepted = 0
        while accepted < len(drafts) and greedy[accepted] == drafts[accepted]:
            accepted += 1
        last = greedy[accepted] if accepted < len(drafts) else sampled[req_id][0]
        sampled[req_id] = [*drafts[:accepted], last]
