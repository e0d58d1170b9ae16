"""What a model-based drafter (runners/draft_model.py, runners/eagle.py) reads of a step once
its tokens are known.

Both drafters keep their KV layers after the target's in each block (one budget, one pool,
one block table; the split moves them with the target's), see every step, and after it guess
k tokens for each request that sampled, greedily (a one-hot proposal, as the rejection
sampler's rule for sampled requests assumes): k passes of one token each. The passes write KV
past the request's tokens, in the lookahead slots the scheduler holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pdserve.runners.inputs import StepInputs, build_step_inputs, to_device


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
    m = len(tokens)
    rows = to_device(np.arange(m), device)
    return build_step_inputs(
        to_device(tokens, device),
        to_device(positions, device),
        rows,
        to_device(np.ones(m, dtype=np.int64), device),
        to_device(positions + 1, device),
        to_device(block_table, device),
        block_size,
        rows,
    )


def chain_guesses(
    guesses: list[list[int]],
    step: DraftStep,
    block_size: int,
    device: torch.device,
    next_guesses: Callable[[StepInputs, np.ndarray], torch.Tensor],
    lag: int = 0,
) -> list[list[int]]:
    """Extend each sampling row's guesses one pass of one token at a time until it has
    step.num_drafts of them: a pass reads each row's last guess (or, with none yet, its last
    token) at that token's position, less `lag` (EAGLE reads the token at t + 1 at position
    t). `next_guesses(inputs, kept)`: the pass's argmax tokens; `kept` marks which of the
    previous pass's rows (at first: the rows that want guesses) are still in it."""
    rows = step.sampling
    last_tokens = step.token_ids[rows, step.num_tokens[rows] - 1]
    tokens = np.array([g[-1] if g else t for g, t in zip(guesses, last_tokens.tolist())])
    done = np.array([len(g) for g in guesses], dtype=np.int64)
    positions = step.num_tokens[rows] - 1 + done - lag
    active = np.flatnonzero(step.num_drafts > 0)  # the rows that want guesses
    first = int(done[active].min()) if active.size else 0
    for j in range(first, int(step.num_drafts.max(initial=0))):
        kept = step.num_drafts[active] > j
        active = active[kept]
        inputs = one_token_inputs(
            tokens[active], positions[active], step.block_table[rows[active]], block_size, device
        )
        guess = next_guesses(inputs, kept).cpu().numpy()
        for i, token in zip(active.tolist(), guess.tolist()):
            guesses[i].append(token)
        tokens[active] = guess
        positions[active] += 1
    return [g[: int(n)] for g, n in zip(guesses, step.num_drafts)]
