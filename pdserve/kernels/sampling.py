"""Sampling: the inputs, the torch reference and the dispatch (Triton kernels: triton/sampling.py).

vLLM's processing order: penalties; greedy rows take the argmax; random rows: temperature ->
min_p -> top-k -> top-p -> a race. The torch race is `argmax(probs / q)`, `q ~ Exp(1)`; the
Triton one its Gumbel-max twin, `argmax(logits + g)`. In both a seeded row's noise depends on
(seed, output position) alone, so its tokens do not depend on the batch it shares a step with;
the two backends' random streams differ. Logprobs are raw: log_softmax of the model's logits.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels import backend
from pdserve.kernels.cpu import native
from pdserve.sampling_params import _GREEDY_EPS

if backend.HAS_TRITON:
    from pdserve.kernels.triton.sampling import sample_tokens_triton, topk_logprobs_triton

_MASK64 = (1 << 64) - 1


@dataclass(kw_only=True)
class SamplingInputs:
    """Per-step knobs for B rows; optional tensors are None when no row uses them."""

    temperature: torch.Tensor  # [B] float32; < _GREEDY_EPS means greedy for that row
    all_greedy: bool
    all_random: bool  # no greedy row: skips the argmax
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None  # [B] float32, 0 = off
    seeds: list[int | None]  # per row; None draws fresh noise every step
    output_positions: list[int]  # per row: tokens the request generated before this one
    output_token_ids: list[list[int]]  # per row, generated so far
    # The penalty tensors and prompt_token_ids are all set (some row has a penalty) or all None.
    prompt_token_ids: list[list[int]] | None
    presence_penalties: torch.Tensor | None  # [B] float32, 0 = off
    frequency_penalties: torch.Tensor | None  # [B] float32, 0 = off
    repetition_penalties: torch.Tensor | None  # [B] float32, 1 = off

    def penalized_rows(self) -> list[int]:
        assert self.presence_penalties is not None and self.frequency_penalties is not None
        assert self.repetition_penalties is not None
        on = (
            (self.repetition_penalties != 1.0)
            | (self.frequency_penalties != 0.0)
            | (self.presence_penalties != 0.0)
        )
        return on.nonzero().flatten().tolist()

    def seen_tokens(
        self, rows: list[int], device: torch.device
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """(i, token id) coordinates of every prompt and every output token of rows[i]."""
        assert self.prompt_token_ids is not None
        return (
            _coords([self.prompt_token_ids[r] for r in rows], device),
            _coords([self.output_token_ids[r] for r in rows], device),
        )


def _coords(lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    index = torch.repeat_interleave(torch.arange(len(lists)), torch.tensor([len(t) for t in lists]))
    return index.to(device), tokens.to(device)


def sample_tokens(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """One token per row of logits [B, V] (any float dtype, never mutated): [B] int64."""
    if backend.use_triton(logits.device):
        return sample_tokens_triton(logits, inputs)
    return sample_tokens_torch(logits, inputs)


def topk_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logprobs: ids and values [B, 1 + k] (column 0 the sampled token, then the k most
    likely), and the sampled token's rank [B]: the number of tokens at least as likely."""
    if backend.use_triton(logits.device):
        return topk_logprobs_triton(logits, sampled, num_logprobs)
    return topk_logprobs_torch(logits, sampled, num_logprobs)


def sample_tokens_torch(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    if inputs.all_greedy and inputs.repetition_penalties is None:
        return argmax_rows(logits)  # the logits' own dtype has the float32 copy's argmax
    logits = process_logits_torch(logits, inputs)
    if inputs.all_greedy:
        return argmax_rows(logits)
    probs = logits.softmax(dim=-1)
    noise = exponential_noise(probs, inputs.seeds, inputs.output_positions)
    sampled = argmax_rows(probs.div_(noise))
    if inputs.all_random:
        return sampled
    return torch.where(inputs.temperature < _GREEDY_EPS, argmax_rows(logits), sampled)


def process_logits_torch(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """Float32 logits with penalties, then for random rows temperature, min_p and top-k/top-p
    masks (-inf) applied. May return `logits` itself when nothing applies; never mutates it."""
    processed = logits.float()
    owned = processed is not logits  # a converted copy is ours to mutate
    if inputs.repetition_penalties is not None:
        # Penalties index the logits flat: they need a contiguous tensor of our own.
        if not owned or not processed.is_contiguous():
            processed = processed.clone(memory_format=torch.contiguous_format)
        owned = True
        apply_penalties(processed, inputs)
    if inputs.all_greedy:
        return processed
    # Greedy rows divide by 1: their argmax is taken from these logits too.
    temperature = torch.where(inputs.temperature < _GREEDY_EPS, 1.0, inputs.temperature)[:, None]
    processed = processed.div_(temperature) if owned else processed / temperature
    if inputs.min_p is not None:
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p)
        threshold = processed.amax(dim=-1, keepdim=True) + inputs.min_p.log()[:, None]
        processed.masked_fill_(processed < threshold, float("-inf"))
    if inputs.top_k is not None or inputs.top_p is not None:
        apply_top_k_top_p(processed, inputs.top_k, inputs.top_p)
    return processed


def apply_penalties(logits: torch.Tensor, inputs: SamplingInputs) -> None:
    """In place. Repetition divides positive / multiplies negative logits of tokens seen in the
    prompt or output; frequency subtracts count * f and presence p over output tokens. Only the
    seen tokens are touched: gathers and scatters on flat indices, no [B, V] masks."""
    assert inputs.prompt_token_ids is not None and inputs.presence_penalties is not None
    assert inputs.frequency_penalties is not None and inputs.repetition_penalties is not None
    assert logits.is_contiguous()
    rows = inputs.penalized_rows()
    if not rows:
        return
    rep, freq, pres = (
        inputs.repetition_penalties,
        inputs.frequency_penalties,
        inputs.presence_penalties,
    )
    vocab_size = logits.shape[1]
    row_ids = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    (prompt_i, prompt_tok), (out_i, out_tok) = inputs.seen_tokens(rows, logits.device)
    flat = logits.view(-1)
    out_idx = row_ids[out_i] * vocab_size + out_tok
    seen_idx = torch.cat([row_ids[prompt_i] * vocab_size + prompt_tok, out_idx])
    # Repeated indices write the same value, so duplicates are harmless here.
    seen = flat[seen_idx]
    factor = rep[seen_idx // vocab_size]
    flat[seen_idx] = torch.where(seen > 0, seen / factor, seen * factor)
    flat.index_add_(0, out_idx, -freq[out_idx // vocab_size])
    out_unique = out_idx.unique()
    flat.index_add_(0, out_unique, -pres[out_unique // vocab_size])


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """In place: masks tokens below the k-th largest logit, then those outside the smallest set
    whose cumulative probability reaches p (at least one token stays). One sort of the values
    gives a cutoff logit per row; tokens tied with the cutoff stay."""
    vocab_size = logits.shape[1]
    values = _sorted_values(logits)  # ascending
    cutoff = values[:, :1]
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
        cutoff = values.gather(1, (vocab_size - k)[:, None])
        if top_p is not None:  # top-p sees the top-k distribution
            values.masked_fill_(values < cutoff, float("-inf"))
    if top_p is not None:
        # Ascending cumulative sum: a token goes when it and everything below it sum to <= 1-p,
        # i.e. when the tokens above it already reach p. The dropped tokens form a prefix.
        cum = values.softmax(dim=-1).cumsum_(dim=-1)
        num_dropped = torch.searchsorted(cum, 1.0 - top_p[:, None], right=True)
        cutoff = values.gather(1, num_dropped.clamp_(max=vocab_size - 1))
    return logits.masked_fill_(logits < cutoff, float("-inf"))


def _sorted_values(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise ascending sort of the values only. On CPU numpy's SIMD sort is ~8x faster than
    torch.sort, which also computes the indices."""
    if logits.device.type == "cpu":
        return torch.from_numpy(np.sort(logits.detach().numpy(), axis=-1))
    return logits.sort(dim=-1).values


def seed_hash(seed: int, position: int) -> int:
    """splitmix64 of (seed, position), as a 63-bit torch seed."""

    def mix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        return x ^ (x >> 31)

    return mix(mix(seed & _MASK64) ^ position) & ((1 << 63) - 1)


def exponential_noise(
    probs: torch.Tensor, seeds: Sequence[int | None], output_positions: Sequence[int]
) -> torch.Tensor:
    """Exp(1) noise [B, V] as -log(U): one batched draw from the default generator for unseeded
    rows; a seeded row draws exactly V uniforms from a generator keyed by (seed, output
    position). (-log U of a float32 uniform is ~4x cheaper than torch's CPU exponential_; U = 0
    gives q = inf, a zero ratio.)"""
    u = torch.empty_like(probs)
    seeded = [i for i, seed in enumerate(seeds) if seed is not None]
    if len(seeded) < len(u):
        u.uniform_()  # one draw for every row; the seeded rows' are drawn again below
    for i in seeded:
        gen = torch.Generator(device=probs.device)
        gen.manual_seed(seed_hash(seeds[i], output_positions[i]))
        u[i].uniform_(generator=gen)
    return u.log_().neg_()


def topk_logprobs_torch(
    logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = logits.float()
    # Ranked on the logits: subtracting the log-sum-exp could round neighbours into a tie.
    ranks = (logits >= logits.gather(1, sampled[:, None])).sum(dim=-1)
    raw = logits.log_softmax(dim=-1)
    sampled_logprobs = raw.gather(1, sampled[:, None])
    top_values, top_ids = raw.topk(min(num_logprobs, raw.shape[1]), dim=-1)
    ids = torch.cat([sampled[:, None], top_ids], dim=1)
    return ids, torch.cat([sampled_logprobs, top_values], dim=1), ranks


_CPU_ARGMAX_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def argmax_cpu(x: torch.Tensor) -> torch.Tensor | None:
    """The first maximum of each row of x [B, V] by csrc/sampling_cpu.cpp, in x's own dtype;
    None where it does not apply (dtype, layout, an empty row, no compiler)."""
    dtype = _CPU_ARGMAX_DTYPES.get(x.dtype)
    if dtype is None or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
        return None
    fn = native.function(
        "sampling_cpu", "pdserve_argmax", ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
    )  # fmt: skip
    if fn is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(dtype, x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
       torch.get_num_threads())  # fmt: skip
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    if backend.use_cpu_kernels(x.device):
        out = argmax_cpu(x)
        if out is not None:
            return out
    # Same first-maximum tie rule as argmax, about 3x faster on CPU for [B, vocab] rows.
    return x.max(dim=-1).indices
