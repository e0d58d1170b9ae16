"""Attention over the paged KV cache: the batch metadata, the torch reference and the dispatch.

A layer's KV cache is a view of shape [num_blocks, 2, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values) into the engine's block-major cache, so one block of every layer
is contiguous in memory (see docs/kv_cache.md). The Triton kernel is in attention_triton.py;
writes into the cache are in kv_cache.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels import backend

if backend.HAS_TRITON:
    from pdserve.kernels.attention_triton import paged_attention_triton


@dataclass
class AttentionMetadata:
    """One step's batch: requests in order, their query tokens flattened into one sequence.

    Request i owns query tokens [query_start_loc[i], query_start_loc[i + 1]) and attends to
    its first seq_lens[i] cached tokens (context + this step's tokens), causally.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64; -1 = padding, not written


def paged_attention_torch(
    query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] against the paged cache.

    The reference pads every request's queries and gathered keys to the batch maximum and
    runs one masked SDPA: simple and exact, at the cost of padding work.
    """
    num_reqs = md.num_reqs
    num_tokens = md.num_actual_tokens
    num_heads, head_dim = query.shape[1], query.shape[2]
    if num_reqs == 0:
        return query.new_empty(0, num_heads, head_dim)
    block_size = kv_cache.shape[2]
    num_blocks = (md.max_seq_len + block_size - 1) // block_size
    max_kv = num_blocks * block_size
    device = query.device

    # index_select of keys and values separately is the fastest CPU gather (several times
    # faster than advanced indexing) and yields contiguous blocks, so the view below is free.
    block_ids = md.block_table[:num_reqs, :num_blocks].reshape(-1).long()
    num_kv_heads = kv_cache.shape[3]
    key = kv_cache[:, 0].index_select(0, block_ids).view(num_reqs, max_kv, num_kv_heads, head_dim)
    value = kv_cache[:, 1].index_select(0, block_ids).view(num_reqs, max_kv, num_kv_heads, head_dim)

    qsl = md.query_start_loc[: num_reqs + 1].long()
    query_lens = qsl[1:] - qsl[:-1]
    seq_lens = md.seq_lens[:num_reqs].long()
    max_q = md.max_query_len
    if max_q == 1:
        padded_q = query[:num_tokens].unsqueeze(1)
        token_req = token_pos = None
    else:
        token_req = torch.repeat_interleave(torch.arange(num_reqs, device=device), query_lens)
        token_pos = torch.arange(num_tokens, device=device) - qsl[token_req]
        padded_q = query.new_zeros(num_reqs, max_q, num_heads, head_dim)
        padded_q[token_req, token_pos] = query[:num_tokens]

    q_positions = (seq_lens - query_lens)[:, None] + torch.arange(max_q, device=device)[None]
    k_positions = torch.arange(max_kv, device=device)
    mask = (k_positions[None, None, :] <= q_positions[:, :, None]) & (
        k_positions[None, None, :] < seq_lens[:, None, None]
    )
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    ).transpose(1, 2)
    if token_req is None:
        return out[:, 0]
    return out[token_req, token_pos]


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] against the paged cache;
    returns [md.num_actual_tokens, num_heads, head_dim] in the query's dtype."""
    if backend.use_triton(query.device):
        return paged_attention_triton(query, kv_cache, md, scale)
    return paged_attention_torch(query, kv_cache, md, scale)
