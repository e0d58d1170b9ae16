"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): at every prompt position but the
first, the logprob of the prompt token given the tokens before it, its rank and the top k.

Only the requests that ask for them cost anything: the runner takes logits at their prompt
positions (every other request has logits at its last token only), chunk by chunk as their
prefill runs, and returns them once, in the step that samples the request's first token. Such
requests take no prefix-cache hits (scheduler/kv_cache_manager.py), so every prompt position is
computed here; a request whose computation starts past position 0 anyway (its KV loaded from a
peer) gets none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from pdserve.outputs import LogprobsLists
from pdserve.sampling_params import SamplingParams

# Prompt positions whose logits are taken at once: [rows, vocab] in fp32 bounds the memory.
MAX_ROWS = 1024

TopkLogprobs = Callable[
    [torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]


@dataclass
class PromptChunk:
    """One request's prompt positions in this step, those whose next token is a prompt token."""

    req_id: str
    flat_start: int  # index in the step's flat batch of the first of them
    target_token_ids: list[int]  # the prompt token each position predicts
    num_logprobs: int


@dataclass
class _Partial:
    """A request's prompt logprobs so far: rows for prompt positions 1, 2, ..."""

    num_logprobs: int
    prompt_token_ids: list[int]
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.ranks) == len(self.prompt_token_ids) - 1


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    chunks: list[PromptChunk],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    topk_logprobs: TopkLogprobs,
) -> list[LogprobsLists]:
    """Each chunk's rows from the step's final hidden states [num_tokens, hidden]: logits at
    its positions, log_softmax in fp32, the target token's logprob and rank and the top k (the
    sampler's kernel; the widest chunk's k, each row cut to its own)."""
    positions = [c.flat_start + j for c in chunks for j in range(len(c.target_token_ids))]
    targets = [t for c in chunks for t in c.target_token_ids]
    num_logprobs = max(c.num_logprobs for c in chunks)
    ids: list[list[int]] = []
    values: list[list[float]] = []
    ranks: list[int] = []
    for start in range(0, len(positions), MAX_ROWS):
        index = torch.tensor(positions[start : start + MAX_ROWS], device=hidden.device)
        target = torch.tensor(targets[start : start + MAX_ROWS], device=hidden.device)
        part = topk_logprobs(compute_logits(hidden[index]), target, num_logprobs)
        ids += part[0].tolist()
        values += part[1].tolist()
        ranks += part[2].tolist()
    rows, row = [], 0
    for c in chunks:
        end, width = row + len(c.target_token_ids), c.num_logprobs + 1
        rows.append(
            LogprobsLists(
                [r[:width] for r in ids[row:end]],
                [r[:width] for r in values[row:end]],
                ranks[row:end],
            )
        )
        row = end
    return rows


class PromptLogprobsTracker:
    """The requests whose prompt logprobs are owed, and what they have so far.

    Empty unless a request asked for them, so that a step without one pays one test.
    """

    def __init__(self) -> None:
        self.pending: dict[str, _Partial] = {}

    def add_request(
        self,
        req_id: str,
        params: SamplingParams,
        prompt_token_ids: list[int],
        num_output_tokens: int,
    ) -> None:
        """A request the runner (re)starts from position 0; one with output tokens had its
        prompt logprobs returned with the first of them."""
        if params.prompt_logprobs is None or num_output_tokens:
            self.pending.pop(req_id, None)
            return
        self.pending[req_id] = _Partial(params.prompt_logprobs, prompt_token_ids)

    def remove_request(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def chunks(self, scheduled: Iterable[tuple[str, int, int, int]]) -> list[PromptChunk]:
        """The step's chunks, from (req_id, first position, token count, flat start) of each
        pending request the step computes."""
        chunks = []
        for req_id, start, num_tokens, flat_start in scheduled:
            partial = self.pending[req_id]
            if start == 0:  # computed again from the start (after a preemption): anew
                partial.token_ids, partial.logprobs, partial.ranks = [], [], []
            end = min(start + num_tokens, len(partial.prompt_token_ids) - 1)
            if end <= start or start != len(partial.ranks):
                continue
            chunks.append(
                PromptChunk(
                    req_id,
                    flat_start,
                    partial.prompt_token_ids[start + 1 : end + 1],
                    partial.num_logprobs,
                )
            )
        return chunks

    def record(self, chunk: PromptChunk, rows: LogprobsLists) -> None:
        partial = self.pending[chunk.req_id]
        partial.token_ids += rows.logprob_token_ids
        partial.logprobs += rows.logprobs
        partial.ranks += rows.sampled_token_ranks

    def pop_sampled(self, sampled_req_ids: Iterable[str]) -> dict[str, LogprobsLists] | None:
        """The prompt logprobs of the pending requests that sampled (their prompt is done)."""
        done = {}
        for req_id in sampled_req_ids:
            partial = self.pending.pop(req_id, None)
            if partial is not None and partial.complete:
                done[req_id] = LogprobsLists(partial.token_ids, partial.logprobs, partial.ranks)
        return done or None
