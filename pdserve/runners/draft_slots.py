"""Speculative decoding under async scheduling: the drafts of a request whose previous step is
still in flight are scheduled as DRAFT_PLACEHOLDER slots, for only the runner knows that
step's tokens; it fills them here, with the n-gram's guesses over its own token table or the
guesses its model drafter made after that step.

The scheduler counted the previous step's drafts as accepted when it scheduled this one, so a
request's `num_computed_tokens` from it may run ahead; the runner keeps its own count (each
step's scheduled tokens less its rejected drafts). A request with fewer guesses than slots
computes the slots past them and drops them: they are not verified, and the scheduler counts
them rejected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from pdserve.config.speculative import SpeculativeConfig
from pdserve.scheduler.drafts import propose_ngram
from pdserve.scheduler.output import DRAFT_PLACEHOLDER


class TokenTable(Protocol):
    """A runner's per-request token table (V1's InputBatch, V2's RequestStates)."""

    def known_tokens(self, row: int) -> np.ndarray: ...

    def write_drafts(self, row: int, drafts: list[int]) -> None:
        """After the row's known tokens, not counted among them."""


class DraftSlots:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        # The model drafter's guesses after the last step, for each request that sampled.
        self.proposals: dict[str, list[int]] = {}

    def fill(
        self, spec: dict[str, list[int]], known_tokens: Callable[[str], np.ndarray]
    ) -> tuple[dict[str, list[int]], dict[str, int]]:
        """The drafts to verify (the scheduler's, or the guesses in its placeholder slots) and
        how many of each request's placeholder slots got a guess. `known_tokens(req_id)`: the
        request's tokens, those of the steps before this one included."""
        drafts: dict[str, list[int]] = {}
        filled: dict[str, int] = {}
        for req_id, scheduled in spec.items():
            if scheduled[0] != DRAFT_PLACEHOLDER:
                drafts[req_id] = scheduled
                continue
            own = self._guess(req_id, len(scheduled), known_tokens)
            filled[req_id] = len(own)
            if own:
                drafts[req_id] = own
        return drafts, filled

    def _guess(self, req_id: str, k: int, known_tokens: Callable[[str], np.ndarray]) -> list[int]:
        config = self.config
        if config.method == "ngram":
            low, high = config.prompt_lookup_min, config.prompt_lookup_max
            assert low is not None and high is not None
            return propose_ngram(known_tokens(req_id), low, high, k)
        return self.proposals.get(req_id, [])[:k]


def num_valid_tokens(
    num_scheduled: np.ndarray,
    row_of: dict[str, int],
    spec: dict[str, list[int]],
    tokens: dict[str, list[int]],
) -> np.ndarray:
    """Each row's scheduled tokens that hold the right tokens: all but its rejected drafts
    (its draft slots past the accepted ones and the token after them)."""
    num_valid = num_scheduled.copy()
    for req_id, slots in spec.items():
        num_valid[row_of[req_id]] -= len(slots) - (len(tokens[req_id]) - 1)
    return num_valid


def verified_ends(
    span_ends: list[int],
    sampling_req_ids: list[str],
    spec: dict[str, list[int]],
    drafts: dict[str, list[int]],
) -> list[int]:
    """Where each sampling request's verified tokens end in the step's flat batch: its
    scheduled tokens end at `span_ends`, the slots left unfilled last."""
    return [
        end - len(spec.get(r, ())) + len(drafts.get(r, ()))
        for end, r in zip(span_ends, sampling_req_ids)
    ]
