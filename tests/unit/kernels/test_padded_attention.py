"""The Triton attention kernel on batches padded to a CUDA-graph bucket (runners/v2/cudagraph.py):
padding requests of query and sequence length 1 or 0, bounds for max_query_len and max_seq_len.
The real tokens' outputs must match the torch reference on the unpadded batch."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.attention import AttentionMetadata, paged_attention_torch
from pdserve.kernels.triton.attention import paged_attention_triton
from pdserve.runners.inputs import StepInputs
from pdserve.runners.v2.cudagraph import StaticInputs, batch_descriptors, select_descriptor

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE, MAX_MODEL_LEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 32, 4, 2, 16


def _batch(query_lens: list[int], seq_lens: list[int]) -> tuple[StepInputs, torch.Tensor]:
    """A step of requests with disjoint shuffled blocks, and the engine-like cache it reads
    (block 0, the null block, zero as the engine leaves it)."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_req = MAX_MODEL_LEN // BLOCK_SIZE
    num_blocks = len(seq_lens) * blocks_per_req + 1
    cache = torch.randn(num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    cache[0] = 0
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[: len(seq_lens) * blocks_per_req]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    num_tokens = int(query_start_loc[-1])
    md = AttentionMetadata(
        num_reqs=len(seq_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=query_start_loc.to(torch.int32).to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table.view(len(seq_lens), blocks_per_req).to(torch.int32).to(DEVICE),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=DEVICE),
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE)
    return StepInputs(ids, ids, md, ids), cache.to(DEVICE)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1], [5, 17, 9]), ([1, 6, 1], [12, 6, 3])],
    ids=["decode", "mixed"],
)
def test_triton_attention_on_a_padded_batch(query_lens: list[int], seq_lens: list[int]) -> None:
    step, cache = _batch(query_lens, seq_lens)
    md = step.attn_metadata
    desc = select_descriptor(batch_descriptors(8, 64), md.num_actual_tokens, md.max_query_len)
    assert desc is not None and desc.num_tokens > md.num_reqs
    static = StaticInputs(desc.num_tokens, MAX_MODEL_LEN // BLOCK_SIZE, MAX_MODEL_LEN, DEVICE)
    padded = static.fill(step, desc).attn_metadata
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(desc.num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    out = paged_attention_triton(query, cache, padded, HEAD_DIM**-0.5)
    expected = paged_attention_torch(query[: md.num_actual_tokens], cache, md, HEAD_DIM**-0.5)
    assert out.shape[0] == desc.num_tokens and not out.isnan().any()
    torch.testing.assert_close(out[: md.num_actual_tokens], expected, atol=1e-4, rtol=1e-4)
