"""Runner V2's input preparation: gather one step's inputs from the request-state table.

Everything is indexed by `idx_mapping` (batch position -> state row), so no per-request host
work happens; the torch reference here is what a GPU kernel replaces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    req_indices: torch.Tensor  # [num_tokens] batch position of each token
    seq_lens: torch.Tensor  # [num_reqs]
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req]


def prepare_inputs(
    idx_mapping: torch.Tensor,
    query_lens: torch.Tensor,
    num_tokens: int,
    all_token_ids: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    block_table: torch.Tensor,
) -> PreparedInputs:
    num_reqs = idx_mapping.shape[0]
    device = idx_mapping.device
    req_indices = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), query_lens, output_size=num_tokens
    )
    query_start = torch.cumsum(query_lens, dim=0) - query_lens
    offsets = torch.arange(num_tokens, device=device) - query_start[req_indices]
    computed = num_computed_tokens[idx_mapping]
    positions = computed[req_indices] + offsets
    input_ids = all_token_ids[idx_mapping[req_indices], positions]
    return PreparedInputs(
        input_ids=input_ids,
        positions=positions,
        req_indices=req_indices,
        seq_lens=computed + query_lens,
        block_table=block_table[idx_mapping],
    )
