"""A step's flat batch, as both runners hand it to the model: V1 builds it from host arrays,
V2 from the input-prep kernel's output."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.input_prep import PreparedInputs


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    # Index into the flat batch of the last token of each request that samples this step.
    logits_indices: torch.Tensor  # [num_sampling_reqs] int64


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A device tensor of values, without a host sync on CUDA."""
    if device.type != "cuda":
        return torch.from_numpy(values)
    return torch.from_numpy(values).pin_memory().to(device, non_blocking=True)


def build_step_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    req_indices: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    sampling_rows: torch.Tensor,
) -> StepInputs:
    """Attach the slot mapping and attention metadata to already gathered token inputs.

    `req_indices[t]` is the batch row of token t, `block_table` holds one row per request in
    batch order, and `sampling_rows` are the batch rows whose last token is sampled.
    """
    num_reqs = query_lens.shape[0]
    block_numbers = block_table[req_indices, positions // block_size].long()
    slot_mapping = block_numbers * block_size + positions % block_size
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32, device=query_lens.device)
    torch.cumsum(query_lens, dim=0, out=query_start_loc[1:])
    md = AttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=input_ids.shape[0],
        max_query_len=int(query_lens.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.to(torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
    )
    logits_indices = query_start_loc[1:][sampling_rows].long() - 1
    return StepInputs(input_ids, positions, md, logits_indices)


def step_inputs_from_prepared(
    prepared: PreparedInputs,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    logits_indices: torch.Tensor,
) -> StepInputs:
    """Runner V2's step: the kernel-prepared inputs plus what the host knows without a sync."""
    md = AttentionMetadata(
        num_reqs=prepared.seq_lens.shape[0],
        num_actual_tokens=prepared.input_ids.shape[0],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        query_start_loc=query_start_loc,
        seq_lens=prepared.seq_lens,
        block_table=prepared.block_table,
        slot_mapping=prepared.slot_mapping,
    )
    return StepInputs(prepared.input_ids, prepared.positions, md, logits_indices)
