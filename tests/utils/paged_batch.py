"""A paged KV cache and step inputs for running a model directly, without an engine.

The cache is block-major like the engine's, [num_blocks, num_layers, 2 (or 1: a latent),
block_size, kv_heads, head_dim], so layer i's view is cache[:, i]. Blocks are handed out in a shuffled order, so
that a request's blocks are neither contiguous nor ascending.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.kernels.attention import AttentionMetadata
from pdserve.models.registry import get_model_class
from pdserve.models.utils import kv_cache_geometry


@dataclass
class PagedKVCache:
    cache: torch.Tensor
    block_size: int
    free_blocks: list[int]
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    num_computed_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def layer_caches(self) -> list[torch.Tensor]:
        return [self.cache[:, i].expand(-1, 2, -1, -1, -1) for i in range(self.cache.shape[1])]


def make_kv_cache(
    hf_config: PretrainedConfig,
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedKVCache:
    """The cache of the model `hf_config` describes, as its attention layers hold it (in a TP
    group: this rank's share)."""
    with torch.device("meta"):
        model = get_model_class(hf_config.architectures[0])(hf_config, torch.float32)
    g = kv_cache_geometry(model)
    shape = (num_blocks, g.num_layers, g.kv_parts, block_size, g.num_kv_heads, g.head_dim)
    # Large garbage, so that attending to a slot nobody wrote shows up in the logits. Not NaN:
    # the reference attention multiplies masked slots by a zero weight, and 0 * NaN is NaN.
    gen = torch.Generator().manual_seed(seed)
    cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    free_blocks = list(range(1, num_blocks))  # block 0 stays unused, as the engine's null block
    random.Random(seed).shuffle(free_blocks)
    return PagedKVCache(cache, block_size, free_blocks)


def build_step(
    kv: PagedKVCache, scheduled: list[tuple[str, list[int]]]
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) of one step: each (request id, token ids) appends its
    tokens after the request's cached ones. Allocates blocks as needed."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens = []
    for req_id, token_ids in scheduled:
        start = kv.num_computed_tokens.get(req_id, 0)
        end = start + len(token_ids)
        table = kv.block_tables.setdefault(req_id, [])
        while len(table) * kv.block_size < end:
            table.append(kv.free_blocks.pop())
        for pos in range(start, end):
            slots.append(table[pos // kv.block_size] * kv.block_size + pos % kv.block_size)
        input_ids.extend(token_ids)
        positions.extend(range(start, end))
        query_start_loc.append(query_start_loc[-1] + len(token_ids))
        seq_lens.append(end)
        kv.num_computed_tokens[req_id] = end
    tables = [kv.block_tables[req_id] for req_id, _ in scheduled]
    block_table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_table[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=len(scheduled),
        num_actual_tokens=len(input_ids),
        max_query_len=max(len(t) for _, t in scheduled),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    return torch.tensor(input_ids), torch.tensor(positions), metadata


@torch.inference_mode()
def run_step(
    model: nn.Module, kv: PagedKVCache, scheduled: list[tuple[str, list[int]]]
) -> list[torch.Tensor]:
    """Run one step; the logits [num_tokens, vocab] of every scheduled token, per request."""
    input_ids, positions, metadata = build_step(kv, scheduled)
    hidden_states = model(input_ids, positions, kv.layer_caches, metadata)
    logits = model.compute_logits(hidden_states)
    return list(logits.split([len(t) for _, t in scheduled]))
