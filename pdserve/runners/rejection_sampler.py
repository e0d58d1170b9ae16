"""Speculative decoding's verification on the runner's side: the rejection sampler.

A drafting request's step computes its next token and its k drafts, and gets k + 1 logits rows:
row j (j < k) is the target's distribution p_j after the tokens up to draft j - 1, and checks
draft j; row k gives the token after the last draft. Each row is sampled as a one-token step
would sample it, its sampler inputs those of a step with the drafts before it already output
(penalties, min_tokens, seeded noise by output position).

- Greedy rows: draft j is accepted while it equals the argmax of row j; at the first mismatch
  the argmax is the step's last token. The logits are the same bits row by row as a step of one
  token computes them (batch invariance), so the tokens are those of decoding without drafts.
- Random rows (Leviathan et al., with the n-gram drafter's one-hot proposal q): draft j is
  accepted with probability p_j(draft j); else the step ends on a token drawn from
  max(p_j - q, 0) normalised, i.e. p_j without the draft. Each emitted token is distributed
  as p_j, as decoding without drafts would draw it.

With every draft accepted, row k's token is the step's last.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdserve.kernels.sampling import (
    argmax_rows,
    exponential_noise,
    process_logits_torch,
    sample_tokens_torch,
    seed_hash,
)
from pdserve.outputs import LogprobsLists
from pdserve.runners.sampler import SamplingMetadata, SamplingRow, apply_host_steps
from pdserve.sampling_params import _GREEDY_EPS

# Salt between a seeded row's sampling noise and its acceptance draw at the same position.
_ACCEPT_SALT = 0x5BD1E995


@dataclass
class DraftRows:
    """The step's sampling requests laid out one logits row per token to verify."""

    logits_indices: np.ndarray  # the step's token index of each row
    draft_token_ids: list[int | None]  # the draft each row checks; None on a request's last
    num_rows: list[int]  # per sampling request: 1 + its drafts
    row_req_ids: list[str]

    @classmethod
    def build(
        cls, spec: dict[str, list[int]], sampling_req_ids: list[str], ends: list[int]
    ) -> DraftRows:
        """`ends`: the exclusive end of each sampling request's scheduled tokens, its drafts
        the last of them."""
        indices: list[int] = []
        drafts: list[int | None] = []
        num_rows: list[int] = []
        row_req_ids: list[str] = []
        for req_id, end in zip(sampling_req_ids, ends):
            own = spec.get(req_id, [])
            indices.extend(range(end - len(own) - 1, end))
            drafts.extend([*own, None])
            num_rows.append(len(own) + 1)
            row_req_ids.extend([req_id] * (len(own) + 1))
        return cls(np.array(indices, dtype=np.int64), drafts, num_rows, row_req_ids)

    def expand(self, rows: list[SamplingRow]) -> list[SamplingRow]:
        """Each request's sampling row once per logits row, the drafts before it output."""
        expanded: list[SamplingRow] = []
        offset = 0
        for row, n in zip(rows, self.num_rows):
            drafts = self.draft_token_ids[offset : offset + n - 1]
            offset += n
            expanded.append(row)
            expanded.extend(
                replace(row, output_token_ids=[*row.output_token_ids, *drafts[: j + 1]])
                for j in range(n - 1)
            )
        return expanded


def rejection_sample(
    logits: torch.Tensor, md: SamplingMetadata, rows: DraftRows
) -> tuple[list[list[int]], torch.Tensor]:
    """Each sampling request's tokens (its accepted drafts and one more), and the token each
    logits row stands for (its draft where accepted), for the logprobs."""
    has_draft = torch.tensor([d is not None for d in rows.draft_token_ids], device=logits.device)
    drafts = torch.tensor([d or 0 for d in rows.draft_token_ids], device=logits.device)
    logits = apply_host_steps(logits, md)
    if md.all_greedy:
        tokens = sample_tokens_torch(logits, md)
        accepted = tokens == drafts
    else:
        processed = process_logits_torch(logits, md)
        tokens = argmax_rows(processed)
        probs = processed.softmax(dim=-1)
        random = md.temperature >= _GREEDY_EPS
        accept_random = _uniforms(md, probs.device) < probs.gather(1, drafts[:, None])[:, 0]
        accepted = torch.where(random, accept_random, tokens == drafts)
        accepted &= has_draft
        # Only the row where a request stops draws its token: the noise of rows after it
        # would go unused (a row's noise is keyed by its output position, not by its batch).
        is_random = random.tolist()
        stops = [i for i in _stop_rows(accepted.tolist(), rows.num_rows) if is_random[i]]
        if stops:
            index = torch.tensor(stops, device=probs.device)
            residual = probs[index]
            # p without the draft (a request's last row has none and keeps p whole).
            stop_drafts = drafts[index]
            residual[has_draft[index], stop_drafts[has_draft[index]]] = 0.0
            noise = exponential_noise(
                residual, [md.seeds[i] for i in stops], [md.output_positions[i] for i in stops]
            )
            tokens[index] = argmax_rows(residual.div_(noise))
    accepted &= has_draft
    chosen = torch.where(accepted, drafts, tokens)
    return _walk(chosen.tolist(), accepted.tolist(), rows.num_rows), chosen


def _stop_rows(accepted: list[bool], num_rows: list[int]) -> list[int]:
    """Each request's row that ends its tokens: its first draft not accepted, or its last."""
    stops = []
    offset = 0
    for n in num_rows:
        end = offset
        while accepted[end]:  # a request's last row has no draft: never accepted
            end += 1
        stops.append(end)
        offset += n
    return stops


def _walk(chosen: list[int], accepted: list[bool], num_rows: list[int]) -> list[list[int]]:
    """Per request: its rows' tokens up to and including the first not accepted."""
    starts = itertools.accumulate(num_rows, initial=0)
    return [chosen[start : stop + 1] for start, stop in zip(starts, _stop_rows(accepted, num_rows))]


def _uniforms(md: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """U[0, 1) per row; a seeded row's keyed by (seed, output position) like its noise."""
    u = torch.rand(len(md.seeds), device=device)
    for i, seed in enumerate(md.seeds):
        if seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed_hash(seed ^ _ACCEPT_SALT, md.output_positions[i]))
            u[i] = torch.rand(1, generator=gen, device=device)[0]
    return u


def emitted_logprobs(
    lists: LogprobsLists, tokens: list[list[int]], rows: DraftRows
) -> LogprobsLists:
    """The logprobs rows of the emitted tokens, request after request (a request's rows start
    at its first logits row), with `cu_num_generated_tokens` marking each request's rows."""
    keep: list[int] = []
    cu = [0]
    offset = 0
    for own, n in zip(tokens, rows.num_rows):
        keep.extend(range(offset, offset + len(own)))
        cu.append(cu[-1] + len(own))
        offset += n
    return LogprobsLists(
        [lists.logprob_token_ids[i] for i in keep],
        [lists.logprobs[i] for i in keep],
        [lists.sampled_token_ranks[i] for i in keep],
        cu,
    )
