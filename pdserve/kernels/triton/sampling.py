"""The sampling kernels' launches (sampling_kernels.py): tiles sized by the batch, and the
inputs each kernel reads laid out once per step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

from pdserve import envs
from pdserve.kernels.triton.launch_configs import SAMPLING_TILE
from pdserve.kernels.triton.sampling_kernels import (
    PROMPT_FLAG,
    SEED_MASK,
    UNSEEDED_STREAM,
    gumbel_sample_kernel,
    logprobs_kernel,
    penalties_temperature_kernel,
    truncate_kernel,
)

if TYPE_CHECKING:
    from pdserve.kernels.sampling import SamplingInputs


def _tiles(num_rows: int, vocab_size: int) -> tuple[int, int, tuple[int]]:
    """(BLOCK_B, BLOCK_V, grid) for a [num_rows, vocab_size] pass. A vocabulary under
    SAMPLING_TILE / 2 packs rows by the batch's size, which changes the layout a row's sums are
    reduced over: under PDSERVE_BATCH_INVARIANT each row has a program of its own."""
    block_v = min(triton.next_power_of_2(vocab_size), SAMPLING_TILE)
    block_b = min(triton.next_power_of_2(num_rows), SAMPLING_TILE // block_v)
    if envs.batch_invariant():
        block_b = 1
    return block_b, block_v, (triton.cdiv(num_rows, block_b),)


def process_logits_triton(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """As process_logits_torch: float32 logits with penalties, then for random rows temperature,
    min_p and top-k/top-p masks; `logits` itself (any dtype) when nothing applies."""
    num_rows, vocab_size = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    device = logits.device
    rows = inputs.penalized_rows() if inputs.repetition_penalties is not None else []
    if not rows and inputs.all_greedy:
        return logits
    block_b, block_v, grid = _tiles(num_rows, vocab_size)
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    # Placeholders where the kernel reads nothing.
    counts = count_row = out
    penalties = (out, out, out)
    if rows:
        counts, count_row = _seen_counts(inputs, rows, num_rows, vocab_size, device)
        penalties = (
            inputs.repetition_penalties,
            inputs.frequency_penalties,
            inputs.presence_penalties,
        )
    penalties_temperature_kernel[grid](
        out,
        logits,
        logits.stride(0),
        inputs.temperature,
        counts,
        count_row,
        *penalties,
        num_rows,
        vocab_size,
        HAS_PENALTIES=bool(rows),
        APPLY_TEMPERATURE=not inputs.all_greedy,
        BLOCK_B=block_b,
        BLOCK_V=block_v,
    )
    knobs = (inputs.top_k, inputs.top_p, inputs.min_p)
    if not inputs.all_greedy and any(t is not None for t in knobs):
        truncate_kernel[grid](
            out,
            *(out if t is None else t for t in knobs),
            num_rows,
            vocab_size,
            HAS_TOP_K=inputs.top_k is not None,
            HAS_TOP_P=inputs.top_p is not None,
            HAS_MIN_P=inputs.min_p is not None,
            BLOCK_B=block_b,
            BLOCK_V=block_v,
        )
    return out


def _seen_counts(
    inputs: SamplingInputs, rows: list[int], num_rows: int, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [len(rows), V] int32 for the penalized rows only (output count | prompt flag),
    and count_row [B]: each row's line in counts, -1 for rows without penalties."""
    (prompt_i, prompt_tok), (out_i, out_tok) = inputs.seen_tokens(rows, device)
    assert max(map(len, inputs.output_token_ids)) < PROMPT_FLAG
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=device)
    counts[prompt_i, prompt_tok] = PROMPT_FLAG  # before the counts: duplicates are harmless
    ones = torch.ones_like(out_tok, dtype=torch.int32)
    counts.index_put_((out_i, out_tok), ones, accumulate=True)
    count_row = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
    count_row[torch.tensor(rows, device=device)] = torch.arange(
        len(rows), dtype=torch.int32, device=device
    )
    return counts, count_row


def _row_seeds(inputs: SamplingInputs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Philox seed and counter per row: (seed, output position) for a seeded row, else (this
    step's seed from torch's default generator, row). The row's noise depends on these alone."""
    step_seed = int(torch.randint(0, SEED_MASK, ()).item())
    seeds, offsets = [], []
    for row, (seed, position) in enumerate(zip(inputs.seeds, inputs.output_positions)):
        seeds.append(step_seed if seed is None else seed & SEED_MASK)
        offsets.append(UNSEEDED_STREAM | row if seed is None else position)
    return (
        torch.tensor(seeds, dtype=torch.int64, device=device),
        torch.tensor(offsets, dtype=torch.int64, device=device),
    )


def sample_tokens_triton(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    processed = process_logits_triton(logits, inputs)
    num_rows, vocab_size = processed.shape
    block_b, block_v, grid = _tiles(num_rows, vocab_size)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    seeds = offsets = out  # placeholders: all-greedy batches draw no noise
    if not inputs.all_greedy:
        seeds, offsets = _row_seeds(inputs, logits.device)
    gumbel_sample_kernel[grid](
        out,
        processed,
        processed.stride(0),
        inputs.temperature,
        seeds,
        offsets,
        num_rows,
        vocab_size,
        ALL_GREEDY=inputs.all_greedy,
        BLOCK_B=block_b,
        BLOCK_V=block_v,
    )
    return out


def topk_logprobs_triton(
    logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As topk_logprobs_torch. As vLLM, torch.topk picks the ids from the raw logits; the
    kernel computes logprobs for those ids only, never a [B, V] log_softmax."""
    num_rows, vocab_size = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    top_ids = logits.topk(min(num_logprobs, vocab_size), dim=-1).indices
    ids = torch.cat([sampled[:, None], top_ids], dim=1).contiguous()
    values = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    ranks = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    block_b, block_v, grid = _tiles(num_rows, vocab_size)
    logprobs_kernel[grid](
        values,
        ranks,
        logits,
        logits.stride(0),
        ids,
        num_rows,
        vocab_size,
        ids.shape[1],
        BLOCK_B=block_b,
        BLOCK_V=block_v,
        BLOCK_K=triton.next_power_of_2(ids.shape[1]),
    )
    return ids, values, ranks
