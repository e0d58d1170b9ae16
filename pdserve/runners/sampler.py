"""Sampler: turns one step's logits into one token per row, with the kernels of kernels/sampling.py.

Host-side steps run first, in torch: custom logits processors, then the min_tokens mask. Runner
V2 samples with the dispatching kernels (Triton on CUDA); runner V1 always with the torch
reference (it keeps its host-side path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pdserve.kernels import sampling
from pdserve.outputs import LogprobsLists
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.output import GrammarBitmask

logger = logging.getLogger(__name__)

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]

_F32_MAX = torch.finfo(torch.float32).max


@dataclass(kw_only=True)
class SamplingMetadata(sampling.SamplingInputs):
    """The kernels' per-row inputs, plus what the sampler does on the host."""

    min_tokens_blocked: dict[int, list[int]]  # row -> token ids masked to -inf this step
    max_num_logprobs: int | None  # None = no logprobs
    logits_processors: list[list[LogitsProcessor]] | None = None  # per row

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        eos_token_ids: list[int | list[int] | None],
        device: torch.device | str,
        logits_processors: list[list[LogitsProcessor]] | None = None,
    ) -> SamplingMetadata:
        """`eos_token_ids` per row: the id (or ids) min_tokens blocks besides stop_token_ids."""
        assert len(params) == len(output_token_ids) == len(prompt_token_ids) == len(eos_token_ids)
        greedy = [p.greedy for p in params]
        # Truncation knobs are irrelevant for greedy rows: leaving them off there lets an
        # all-greedy-or-default batch skip top-k/top-p altogether.
        top_k = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        has_penalties = any(p.has_penalties for p in params)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]

        min_tokens_blocked: dict[int, list[int]] = {}
        for i, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
            if len(out) < p.min_tokens:
                # As vLLM: EOS is blocked even with ignore_eos (it could not stop the row anyway).
                blocked = list(p.stop_token_ids or ())
                if isinstance(eos, int):
                    blocked.append(eos)
                elif eos is not None:  # a model with several EOS ids
                    blocked.extend(eos)
                if blocked:
                    min_tokens_blocked[i] = blocked

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def penalty(values: list[float]) -> torch.Tensor | None:
            return f32(values) if has_penalties else None

        if logits_processors is not None and not any(logits_processors):
            logits_processors = None
        return cls(
            # Past float32's range a temperature is inf on the device, and a masked logit
            # (-inf: structured outputs, min_tokens) over inf is NaN, which argmax takes; at
            # float32's largest the distribution is already uniform over the allowed tokens.
            temperature=f32([min(p.temperature, _F32_MAX) for p in params]),
            all_greedy=all(greedy),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device) if any(top_k) else None,
            top_p=f32(top_p) if any(p < 1.0 for p in top_p) else None,
            min_p=f32(min_p) if any(min_p) else None,
            seeds=[p.seed for p in params],
            output_positions=[len(out) for out in output_token_ids],
            prompt_token_ids=prompt_token_ids if has_penalties else None,
            output_token_ids=output_token_ids,
            presence_penalties=penalty([p.presence_penalty for p in params]),
            frequency_penalties=penalty([p.frequency_penalty for p in params]),
            repetition_penalties=penalty([p.repetition_penalty for p in params]),
            min_tokens_blocked=min_tokens_blocked,
            max_num_logprobs=max(logprobs) if logprobs else None,
            logits_processors=logits_processors,
            all_random=not any(greedy),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    # Column 0 is the sampled token, then the max_num_logprobs most likely; raw logprobs.
    logprobs: LogprobsLists | None


@dataclass
class SamplingRow:
    """What the sampler needs of one request that samples this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logits_processors: list[Callable[..., torch.Tensor]] | None = None


class Sampler(nn.Module):
    def __init__(self, use_kernels: bool) -> None:
        """use_kernels: dispatch to Triton on CUDA (or when forced); else always the torch
        reference."""
        super().__init__()
        self.sample_tokens: Callable[[torch.Tensor, SamplingMetadata], torch.Tensor] = (
            sampling.sample_tokens if use_kernels else sampling.sample_tokens_torch
        )
        self.topk_logprobs: Callable[
            [torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = sampling.topk_logprobs if use_kernels else sampling.topk_logprobs_torch

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == md.temperature.shape[0]
        # The raw logits stay untouched for the logprobs.
        processed = apply_host_steps(logits, md)
        sampled = self.sample_tokens(processed, md)
        lists = None
        if md.max_num_logprobs is not None:
            ids, values, ranks = self.topk_logprobs(logits, sampled, md.max_num_logprobs)
            lists = LogprobsLists(ids.tolist(), values.tolist(), ranks.tolist())
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lists)


def apply_host_steps(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Logits processors, then the min_tokens mask, on a float32 copy; `logits` itself when
    neither applies."""
    if md.logits_processors is None and not md.min_tokens_blocked:
        return logits
    logits = logits.to(torch.float32, copy=True)
    if md.logits_processors is not None:
        for i, fns in enumerate(md.logits_processors):
            for fn in fns:
                logits[i] = fn(md.output_token_ids[i], logits[i])
    if md.min_tokens_blocked:
        rows = [r for r, ids in md.min_tokens_blocked.items() for _ in ids]
        cols = [t for ids in md.min_tokens_blocked.values() for t in ids]
        logits[rows, cols] = float("-inf")
    return logits


# -inf's bit pattern as the signed integer of the same width: a disallowed token's logit gets it
# added, an allowed one's 0, without a branch per element (masked_fill is 3x slower on CPU).
_NEG_INF_BITS = {
    torch.float32: (torch.int32, -(2**23)),
    torch.bfloat16: (torch.int16, -(2**7)),
    torch.float16: (torch.int16, -(2**10)),
}


def apply_grammar_bitmask(
    logits: torch.Tensor, grammar: GrammarBitmask, row_req_ids: list[str]
) -> None:
    """Structured outputs: -inf, in place, at the logits of the tokens each constrained row may
    not sample. `row_req_ids`: the request of each logits row; a request with drafts has
    several rows, in order, as its bitmask has."""
    rows_of: dict[str, list[int]] = {}
    for row, req_id in enumerate(row_req_ids):
        rows_of.setdefault(req_id, []).append(row)
    taken: dict[str, int] = {}
    pairs = []
    for i, req_id in enumerate(grammar.req_ids):
        own = rows_of.get(req_id)
        if own is not None:
            nth = taken[req_id] = taken.get(req_id, -1) + 1
            pairs.append((i, own[nth]))
    if not pairs:
        return
    vocab_size = logits.shape[-1]
    words = np.frombuffer(grammar.bitmask, dtype=np.int32).reshape(len(grammar.req_ids), -1)
    mask_rows, rows = zip(*pairs)
    words = words[list(mask_rows)]
    if logits.is_cuda:
        import xgrammar as xgr

        full = torch.full((logits.shape[0], words.shape[1]), -1, dtype=torch.int32)
        full[list(rows)] = torch.from_numpy(words)
        xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), indices=list(rows))
        return
    # Bit t % 32 of word t // 32 is token t: little-endian bytes unpacked little-endian bit
    # first give the tokens in order.
    allowed = np.unpackbits(words.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    int_dtype, neg_inf = _NEG_INF_BITS[logits.dtype]
    bias = (torch.from_numpy(allowed).to(int_dtype) - 1).mul_(-neg_inf).view(logits.dtype)
    index = torch.tensor(rows)
    logits.index_add_(0, index, bias)
