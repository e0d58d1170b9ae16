"""Triton paged attention over a mixed batch: prefill chunks and decodes in one launch.

Grid (query block, kv head, kv split). A query block is BLOCK_Q consecutive query tokens of one
request times the GROUP query heads that share one KV head, so every K/V tile is loaded once per
GQA group. A tile holds BLOCK_N keys gathered through the block table (one tile may span several
cache blocks, or part of one). Softmax is online, in fp32, in the exp2 domain.

Split-K (flash decoding): with num_splits > 1 each program covers one contiguous share of its
request's KV tiles and stores an unnormalized partial (acc, max, sum); a second kernel folds
the shares in order. Decode batches use it when (request, kv head) programs alone leave the GPU
idle. The split count is a runtime argument, so that a batch whose count changes from one step
to the next runs the same binary.

Batch invariance (PDSERVE_BATCH_INVARIANT): the split count above follows the batch, and decode
blocks are shaped unlike prefill blocks, so a query's reduction order depends on its batch.
Under the switch every batch runs prefill-shaped blocks, and every query's keys are split at
BATCH_INVARIANT_SPLIT tokens: a query reduces each split's tiles in order, then folds the
splits in order with `merge` (triton/attention_splits.py). Whether the splits run in one
program each (num_splits > 1, the combine kernel folding them) or one after another in their
block's program (num_splits == 1) is the launcher's choice by batch; both fold the same states
with the same code, so the bits are the same.

An fp8 cache (kernels/kv_cache.py): its codes widen exactly to the dot's dtype, and the scales
apply to what the dots give, k_scale within the softmax scale and v_scale to the weighted sum
of values: one multiply a score and one an output row, not one a cached element, and no
rounding of code x scale to 16 bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pdserve import envs
from pdserve.kernels.kv_cache import FP8_MAX, UNIT_SCALE, KVScale
from pdserve.kernels.triton import launch_configs
from pdserve.kernels.triton.attention_splits import combine_splits, merge, num_splits_heuristic

if TYPE_CHECKING:
    from pdserve.kernels.attention import AttentionMetadata

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    # Request r's query blocks start at program query_start_loc[r] // BLOCK_Q (+ r when a block
    # holds several tokens, since a request's last block may be partial): the owner of program
    # pid is the last request starting at or before it.
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q
        if BLOCK_Q > 1:
            start += mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The request count, the split count and the block table's row length (max_model_len's) are not
# specialized: one binary serves every batch.
@triton.jit(do_not_specialize=["num_reqs", "stride_bt", "num_splits", "window"])
def _paged_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_ptr,
    cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    softcap,
    v_scale,
    window,
    num_reqs,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cb,
    stride_ckv,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
    FP8: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, num_reqs, pid_q, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = pid_q - q_start // BLOCK_Q
    if BLOCK_Q > 1:
        q_block -= req
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    # Row m is query token m // GROUP_PAD of the block, head m % GROUP_PAD of the group; rows
    # past BLOCK_Q tokens only pad a decode block up to the 16 rows tl.dot needs.
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_valid = (
        (offs_m // GROUP_PAD < BLOCK_Q) & (q_local < query_len) & (offs_m % GROUP_PAD < GROUP)
    )
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    token = q_start + q_local
    q_ptrs = query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(
        q_ptrs + offs_d[None, :] * stride_qd, mask=row_valid[:, None] & d_valid[None, :], other=0.0
    )
    # Products run in the cache's dtype with fp32 accumulation (in fp32 under the interpreter).
    q = q.to(DOT_DTYPE)

    # Causal: a row sees keys up to its own position; the block's last token bounds the keys.
    q_pos = context_len + q_local
    kv_len = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    # A window: tiles wholly before the block's first query's window hold no key it sees.
    first_tile = 0
    if window > 0:
        first_tile = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0) // BLOCK_N
    # Splits of SPLIT_TILES tiles (batch invariance), else num_splits equal shares. One program
    # per split, or, when the grid has one, this program runs every split in turn.
    if SPLIT_TILES > 0:
        split_tiles = SPLIT_TILES
    else:
        split_tiles = tl.cdiv(num_tiles, num_splits)
    split_lo = split
    split_hi = split + 1
    if num_splits == 1:
        split_hi = tl.cdiv(num_tiles, split_tiles)

    # A finite floor, so that a row with every key of a split masked gives p = 0, not NaN.
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_table_ptr + req * stride_bt
    for s_idx in range(split_lo, split_hi):
        tile_lo = s_idx * split_tiles
        tile_hi = tl.minimum(tile_lo + split_tiles, num_tiles)
        tile_lo = tl.maximum(tile_lo, first_tile)
        m_s = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
        l_s = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_s = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for tile in range(tile_lo, tile_hi):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            n_valid = offs_n < kv_len
            block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
            slot = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
            k = tl.load(
                cache_ptr + slot[None, :] + offs_d[:, None] * stride_cd,
                mask=n_valid[None, :] & d_valid[:, None],
                other=0.0,
            )
            v = tl.load(
                cache_ptr + stride_ckv + slot[:, None] + offs_d[None, :] * stride_cd,
                mask=n_valid[:, None] & d_valid[None, :],
                other=0.0,
            )
            s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
            if softcap > 0:  # in the log2 domain: softcap and scores both carry log2(e)
                s = softcap * (2 * tl.sigmoid(2 * s / softcap) - 1)
            seen = offs_n[None, :] <= q_pos[:, None]
            if window > 0:
                seen = seen & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_s, tl.max(s, 1))
            alpha = tl.exp2(m_s - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_s = l_s * alpha + tl.sum(p, 1)
            acc_s = acc_s * alpha[:, None]
            acc_s = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc_s, input_precision=DOT_PRECISION)
            m_s = m_new
        if FP8:  # each split's own, so that its partial is folded the same in either kernel
            acc_s *= v_scale
        m_i, l_i, acc = merge(m_i, l_i, acc, m_s, l_s, acc_s)

    out_mask = row_valid[:, None] & d_valid[None, :]
    # Out is contiguous [num_tokens, num_heads, HEAD_DIM], partials [.., num_splits(, HEAD_DIM)].
    out_row = token * tl.num_programs(1) * GROUP + head
    if num_splits == 1:
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
    else:
        row = out_row * num_splits + split
        tl.store(part_max_ptr + row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + row, l_i, mask=row_valid)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)


# tl.dot on 16-bit inputs is wrong in the interpreter (triton#11584), so it multiplies in fp32
# there. The jit decorator picked the interpreter or the compiler from this same knob.
_INTERPRET = bool(triton.knobs.runtime.interpret)
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
    batch_invariant: bool | None = None,
    window: int = 0,
    softcap: float = 0.0,
    kv_scale: KVScale = UNIT_SCALE,
) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_dim] against the paged cache
    (Triton), over each query's last `window` keys (0: all), scores soft-capped at `softcap`
    (0: not), an fp8 cache's codes times `kv_scale`; num_splits overrides the split-K heuristic.
    batch_invariant (default: PDSERVE_BATCH_INVARIANT) splits every query's keys at
    BATCH_INVARIANT_SPLIT tokens instead; num_splits (or the heuristic) then only chooses whether
    those splits run in a program each (> 1) or one after another (1), which gives the same
    bits."""
    if batch_invariant is None:
        batch_invariant = envs.batch_invariant()
    num_tokens = md.num_actual_tokens
    num_heads, head_dim = query.shape[1], query.shape[2]
    out = query.new_empty(num_tokens, num_heads, head_dim)
    if md.num_reqs == 0 or num_tokens == 0:
        return out
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Decode blocks hold one token (padded up to DOT_MIN rows), prefill blocks ATTENTION_ROWS
    # rows. A token's scores are reduced over its block's layout, which differs between the two,
    # so under batch invariance every block is prefill-shaped.
    decode = md.max_query_len == 1 and not batch_invariant
    block_q = 1 if decode else max(1, launch_configs.ATTENTION_ROWS // group_pad)
    block_m = max(launch_configs.DOT_MIN, block_q * group_pad)
    block_n = launch_configs.attention_block_n(head_dim)
    block_d = max(launch_configs.DOT_MIN, triton.next_power_of_2(head_dim))
    num_q_blocks = num_tokens // block_q + (md.num_reqs if block_q > 1 else 0)
    if num_splits is None:
        num_sms = (
            torch.cuda.get_device_properties(query.device).multi_processor_count
            if query.device.type == "cuda"
            else 1  # the interpreter runs programs one after another: splits only add work
        )
        num_splits = num_splits_heuristic(
            num_q_blocks * num_kv_heads, md.max_query_len, md.max_seq_len, block_q, block_n, num_sms
        )
    split_tiles = 0
    if batch_invariant:
        split_tiles = launch_configs.BATCH_INVARIANT_SPLIT // block_n
        # As many programs as the longest query has splits, where that count is affordable.
        needed = triton.cdiv(triton.cdiv(md.max_seq_len, block_n), split_tiles)
        num_splits = needed if num_splits > 1 and needed <= launch_configs.MAX_SPLITS else 1
    if num_splits > 1:
        part_out = query.new_empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32)
        part_max = query.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        # Unused by the kernel, but float32 as the partials are: one binary for any split count.
        part_out = part_max = part_sum = query.new_empty(1, dtype=torch.float32)
    fp8 = kv_cache.dtype in FP8_MAX
    # The dot runs in the activations' dtype, which holds every fp8 code exactly.
    dot_dtype = query.dtype if fp8 else kv_cache.dtype
    k_scale, v_scale = kv_scale if fp8 else UNIT_SCALE
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        out,
        part_out,
        part_max,
        part_sum,
        query,
        kv_cache,
        md.block_table,
        md.query_start_loc,
        md.seq_lens,
        scale * k_scale * _LOG2E,
        softcap * _LOG2E,
        v_scale,
        window,
        md.num_reqs,
        *query.stride(),
        *kv_cache.stride(),
        md.block_table.stride(0),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_DTYPE=tl.float32 if _INTERPRET else _DOT_DTYPES[dot_dtype],
        DOT_PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
        SPLIT_TILES=split_tiles,
        FP8=fp8,
        num_warps=launch_configs.ATTENTION_NUM_WARPS,
        num_stages=launch_configs.ATTENTION_NUM_STAGES,
    )
    if num_splits > 1:
        combine_splits(out, part_out, part_max, part_sum, group, group_pad, block_d)
    return out
