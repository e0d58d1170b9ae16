"""Split-K of the Triton paged attention (triton/attention.py): how many KV splits a batch gets,
the fold of one split's softmax state into another's, and the kernel that folds the splits'
partials when each ran in a program of its own."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton import launch_configs

# Each split gets at least this many tiles, so that its partial write stays small next to its
# KV reads.
_MIN_TILES_PER_SPLIT = 4
# Aim for this many programs per SM, so that the last wave is a small share of the work.
_PROGRAMS_PER_SM = 4


def num_splits_heuristic(
    num_programs: int,
    max_query_len: int,
    max_seq_len: int,
    block_q: int,
    block_n: int,
    num_sms: int,
) -> int:
    """KV splits per (query block, kv head): enough programs to fill num_sms SMs a few times
    over, each split still long enough to amortize its partial write. Prefill blocks are many
    and long already, so only decode-sized query blocks are split."""
    if max_query_len > block_q:
        return 1
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, num_programs)
    affordable = triton.cdiv(max_seq_len, block_n) // _MIN_TILES_PER_SPLIT
    return max(1, min(wanted, affordable, launch_configs.MAX_SPLITS))


@triton.jit
def merge(m_i, l_i, acc, m_s, l_s, acc_s):
    # Fold a split's softmax state (max, sum, unnormalized output) into the running one. A split
    # whose keys a row does not see (l_s == 0) leaves it as it is, and the first split a row sees
    # is taken as it is, so a row with one split has exactly that split's state. The explicit
    # fmas round the same way in every kernel that folds.
    m_new = tl.maximum(m_i, m_s)
    alpha = tl.exp2(m_i - m_new)
    beta = tl.exp2(m_s - m_new)
    first = l_i == 0
    skip = l_s == 0
    m_out = tl.where(skip, m_i, tl.where(first, m_s, m_new))
    l_out = tl.where(skip, l_i, tl.where(first, l_s, tl.fma(l_i, alpha, l_s * beta)))
    acc_new = tl.fma(acc, alpha[:, None], acc_s * beta[:, None])
    acc_out = tl.where(skip[:, None], acc, tl.where(first[:, None], acc_s, acc_new))
    return m_out, l_out, acc_out


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_splits,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, kv head), like the attention kernel: it folds the splits in order,
    # as the attention kernel does when one program runs them all. Padding rows past GROUP repeat
    # the group's last head, so that all they load is defined.
    token = tl.program_id(0)
    offs_g = tl.arange(0, GROUP_PAD)
    head = tl.program_id(1) * GROUP + tl.minimum(offs_g, GROUP - 1)
    out_row = token * tl.num_programs(1) * GROUP + head
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    m_i = tl.full([GROUP_PAD], -1e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    for split in range(num_splits):
        row = out_row * num_splits + split
        m_s = tl.load(part_max_ptr + row)
        l_s = tl.load(part_sum_ptr + row)
        acc_s = tl.load(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            mask=d_valid[None, :],
            other=0.0,
        )
        m_i, l_i, acc = merge(m_i, l_i, acc, m_s, l_s, acc_s)
    # The first split holds key 0, visible to every query: the sum is > 0.
    tl.store(
        out_ptr + out_row[:, None] * HEAD_DIM + offs_d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=(offs_g[:, None] < GROUP) & d_valid[None, :],
    )


def combine_splits(
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    group: int,
    group_pad: int,
    block_d: int,
) -> None:
    """Fold the partials [num_tokens, num_heads, num_splits(, head_dim)] into out
    [num_tokens, num_heads, head_dim], GQA groups of `group` query heads."""
    num_tokens, num_heads, num_splits, head_dim = part_out.shape
    _combine_splits_kernel[(num_tokens, num_heads // group)](
        out,
        part_out,
        part_max,
        part_sum,
        num_splits,
        HEAD_DIM=head_dim,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_D=block_d,
    )
