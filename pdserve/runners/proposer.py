"""What a model-based drafter (runners/draft_model.py, runners/eagle.py) reads of a step once
its tokens are known.

Both drafters keep their KV layers after the target's in each block (one budget, one pool,
one block table; the split moves them with the target's), see every step, and after it guess
k tokens for each request that sampled, greedily (a one-hot proposal, as the rejection
sampler's rule for sampled requests assumes): k passes of one token each. The passes write KV
past the request's tokens, in the lookahead slots the scheduler holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pdserve.runners.inputs import StepInputs, build_step_inputs


@dataclass
class DraftStep:
    """A step's scheduled requests (the batch's rows, in order), after its tokens were
    appended."""

    req_ids: list[str]
    token_ids: np.ndarray  # [rows, max_model_len]: every known token
    num_tokens: np.ndarray  # [rows] known tokens, the step's included
    num_computed: np.ndarray  # [rows] computed before the step: its first position
    num_valid: np.ndarray  # [rows] the step's positions that hold the right tokens
    starts: np.ndarray  # [rows] each row's first token in the step's flat batch
    block_table: np.ndarray  # [rows, max blocks]
    sampling: np.ndarray  # the rows that sampled
    num_drafts: np.ndarray  # [len(sampling)] the guesses wanted of each


class Proposer(Protocol):
    k: int
    num_layers: int
    kv_caches: list[torch.Tensor]

    def load(self, target: torch.nn.Module) -> None: ...

    def observe(self, inputs: StepInputs, hidden: torch.Tensor | None) -> None:
        """Called with each step's inputs and the target's final hidden states."""

    def propose(self, step: DraftStep) -> list[list[int]]:
        """The guesses of each sampling row."""


def one_token_inputs(
    tokens: np.ndarray,
    positions: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """A step of one token per row, every row sampling."""

    def to_dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    m = len(tokens)
    rows = np.arange(m)
    return build_step_inputs(
        to_dev(tokens),
        to_dev(positions),
        to_dev(rows),
        to_dev(np.ones(m, dtype=np.int64)),
        to_dev(positions + 1),
        to_dev(block_table),
        block_size,
        to_dev(rows),
    )
