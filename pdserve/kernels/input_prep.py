"""Runner V2's input preparation: gather one step's inputs from the request-state table.

Batch position i reads state row idx_mapping[i] and owns the query tokens
[query_start_loc[i], query_start_loc[i + 1]), which continue after that row's
num_computed_tokens. The host computes idx_mapping and query_start_loc from the scheduler
output (so it knows num_tokens without a sync); everything read from the state table stays on
the device: the Triton path is one launch, one program per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import backend
from pdserve.kernels.triton import launch_configs

if backend.HAS_TRITON:
    import triton
    import triton.language as tl

    # The state table's widths follow max_model_len: not specialized, one binary for any.
    @triton.jit(
        do_not_specialize=[
            "stride_tokens",
            "stride_block_table",
            "stride_out_block_table",
            "num_blocks_per_req",
        ]
    )
    def _prepare_inputs_kernel(
        idx_mapping_ptr,
        query_start_loc_ptr,
        all_token_ids_ptr,
        num_computed_tokens_ptr,
        block_table_ptr,
        input_ids_ptr,
        positions_ptr,
        seq_lens_ptr,
        slot_mapping_ptr,
        out_block_table_ptr,
        stride_tokens,
        stride_block_table,
        stride_out_block_table,
        num_blocks_per_req,
        block_size,
        BLOCK_T: tl.constexpr,
        BLOCK_B: tl.constexpr,
    ):
        req = tl.program_id(0)
        row = tl.load(idx_mapping_ptr + req).to(tl.int64)
        start = tl.load(query_start_loc_ptr + req)
        end = tl.load(query_start_loc_ptr + req + 1)
        computed = tl.load(num_computed_tokens_ptr + row)
        tl.store(seq_lens_ptr + req, (computed + end - start).to(tl.int32))
        tokens_row = all_token_ids_ptr + row * stride_tokens
        table_row = block_table_ptr + row * stride_block_table
        for chunk in range(start, end, BLOCK_T):
            token = chunk + tl.arange(0, BLOCK_T)
            mask = token < end
            pos = computed + (token - start)
            block = tl.load(table_row + pos // block_size, mask=mask).to(tl.int64)
            tl.store(input_ids_ptr + token, tl.load(tokens_row + pos, mask=mask), mask=mask)
            tl.store(positions_ptr + token, pos, mask=mask)
            tl.store(slot_mapping_ptr + token, block * block_size + pos % block_size, mask=mask)
        # The block-table gather rides along in the same program: one launch per step.
        out_row = out_block_table_ptr + req.to(tl.int64) * stride_out_block_table
        for col in range(0, num_blocks_per_req, BLOCK_B):
            offs = col + tl.arange(0, BLOCK_B)
            mask = offs < num_blocks_per_req
            tl.store(out_row + offs, tl.load(table_row + offs, mask=mask), mask=mask)


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    seq_lens: torch.Tensor  # [num_reqs] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32


def prepare_inputs_torch(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    all_token_ids: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> PreparedInputs:
    num_reqs = idx_mapping.shape[0]
    device = idx_mapping.device
    query_start = query_start_loc[:-1].long()
    query_lens = query_start_loc[1:].long() - query_start
    req_indices = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), query_lens, output_size=num_tokens
    )
    computed = num_computed_tokens[idx_mapping]
    offsets = torch.arange(num_tokens, device=device) - query_start[req_indices]
    positions = computed[req_indices] + offsets
    rows = idx_mapping[req_indices]
    block_numbers = block_table[rows, positions // block_size].long()
    return PreparedInputs(
        input_ids=all_token_ids[rows, positions],
        positions=positions,
        seq_lens=(computed + query_lens).to(torch.int32),
        slot_mapping=block_numbers * block_size + positions % block_size,
        block_table=block_table[idx_mapping],
    )


def prepare_inputs_triton(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    all_token_ids: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> PreparedInputs:
    num_reqs = idx_mapping.shape[0]
    device = idx_mapping.device
    out = PreparedInputs(
        input_ids=torch.empty(num_tokens, dtype=all_token_ids.dtype, device=device),
        positions=torch.empty(num_tokens, dtype=torch.int64, device=device),
        seq_lens=torch.empty(num_reqs, dtype=torch.int32, device=device),
        slot_mapping=torch.empty(num_tokens, dtype=torch.int64, device=device),
        block_table=torch.empty(
            num_reqs, block_table.shape[1], dtype=block_table.dtype, device=device
        ),
    )
    if num_reqs == 0:
        return out
    assert all_token_ids.stride(1) == 1 and block_table.stride(1) == 1
    _prepare_inputs_kernel[(num_reqs,)](
        idx_mapping,
        query_start_loc,
        all_token_ids,
        num_computed_tokens,
        block_table,
        out.input_ids,
        out.positions,
        out.seq_lens,
        out.slot_mapping,
        out.block_table,
        all_token_ids.stride(0),
        block_table.stride(0),
        out.block_table.stride(0),
        block_table.shape[1],
        block_size,
        BLOCK_T=launch_configs.PREPARE_BLOCK,
        BLOCK_B=launch_configs.PREPARE_BLOCK,
    )
    return out


def prepare_inputs(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    all_token_ids: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> PreparedInputs:
    """Input ids, positions, seq lens, slot mapping and block table of one step, batch order.

    idx_mapping [num_reqs] (state row of each batch position), query_start_loc [num_reqs + 1]
    (int32, from 0 to num_tokens); all_token_ids [rows, max_model_len], num_computed_tokens
    [rows] (tokens already in the KV cache) and block_table [rows, max_num_blocks_per_req]
    are the state table.
    """
    fn = prepare_inputs_triton if backend.use_triton(idx_mapping.device) else prepare_inputs_torch
    return fn(
        idx_mapping,
        query_start_loc,
        num_tokens,
        all_token_ids,
        num_computed_tokens,
        block_table,
        block_size,
    )
