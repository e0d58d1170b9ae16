"""Triton sampling kernels, after vLLM's Model Runner V2 sampler (sample/gumbel.py).

Every kernel runs on tiles of BLOCK_B rows x BLOCK_V logits and loops over the vocabulary, so
a large vocabulary is one row per program and a tiny one packs many rows into a program.

1. `penalties_temperature_kernel`: one pass, raw logits (any dtype) -> float32 copy with the
   penalties applied and divided by the temperature.
2. `truncate_kernel`: min_p, top-k and top-p without a sort. A row's top-k cutoff is its k-th
   largest logit, found by bisection over the logits' bit patterns (order-preserving int32
   keys: 32 counting passes, exact); the top-p cutoff the largest logit whose tokens at or above
   it hold p of the (top-k) mass, found the same way summing exp instead of counting. Tokens
   below the cutoff become -inf. Costlier in passes than a sort, but no [B, V] index tensors.
3. `gumbel_sample_kernel`: argmax(logits + Gumbel noise), no softmax materialised; greedy rows
   take the plain argmax. Philox noise keyed by (seed, output position) for a seeded row and by
   (a per-step seed from torch's default generator, row) for the others.
4. `logprobs_kernel`: log-sum-exp, the sampled token's rank and the logprobs of the ids that
   torch.topk chose from the raw logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

from pdserve.sampling_params import _GREEDY_EPS

if TYPE_CHECKING:
    pass

# Output counts share an int32 with a prompt flag above them (max_model_len stays below it).
PROMPT_FLAG = 1 << 24
_COUNT_MASK = tl.constexpr(PROMPT_FLAG - 1)
SEED_MASK = (1 << 63) - 1
# Unseeded rows key their noise by (step seed, row); setting the counter's high word keeps those
# streams apart from the seeded rows' (seed, position) ones.
UNSEEDED_STREAM = 1 << 32
_EPS = tl.constexpr(_GREEDY_EPS)


@triton.jit
def _key(x):
    # float32 -> int32 in the same order: negative floats flip their magnitude bits.
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unkey(key):
    b = key.to(tl.int32)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.float32, bitcast=True)


# Row counts are not specialized (== 1, multiple of 16): one binary serves every batch.
@triton.jit(do_not_specialize=["num_rows"])
def penalties_temperature_kernel(
    out_ptr,
    logits_ptr,
    logits_stride,
    temperature_ptr,
    counts_ptr,
    count_row_ptr,
    repetition_ptr,
    frequency_ptr,
    presence_ptr,
    num_rows,
    vocab_size,
    HAS_PENALTIES: tl.constexpr,
    APPLY_TEMPERATURE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < num_rows
    cols = tl.arange(0, BLOCK_V)
    if APPLY_TEMPERATURE:
        t = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)
        t = tl.where(t < _EPS, 1.0, t)  # greedy rows keep their logits for the argmax
    if HAS_PENALTIES:
        count_row = tl.load(count_row_ptr + rows, mask=row_ok, other=-1)
        penalized = count_row >= 0
        rep = tl.load(repetition_ptr + rows, mask=row_ok, other=1.0)[:, None]
        freq = tl.load(frequency_ptr + rows, mask=row_ok, other=0.0)[:, None]
        pres = tl.load(presence_ptr + rows, mask=row_ok, other=0.0)[:, None]
    for start in range(0, vocab_size, BLOCK_V):
        m = row_ok[:, None] & (start + cols < vocab_size)[None, :]
        x = tl.load(
            logits_ptr + rows[:, None].to(tl.int64) * logits_stride + start + cols[None, :],
            mask=m,
            other=0.0,
        ).to(tl.float32)
        if HAS_PENALTIES:
            c = tl.load(
                counts_ptr + count_row[:, None].to(tl.int64) * vocab_size + start + cols[None, :],
                mask=m & penalized[:, None],
                other=0,
            )
            n = (c & _COUNT_MASK).to(tl.float32)  # output count
            x = tl.where(c != 0, tl.where(x > 0, x / rep, x * rep), x)
            x = x - freq * n - tl.where(n > 0, pres, 0.0)
        if APPLY_TEMPERATURE:
            x = x / t[:, None]
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * vocab_size + start + cols[None, :]
        tl.store(out_ptrs, x, mask=m)


@triton.jit
def _count_at_least(
    row_ptr, row_ok, threshold, vocab_size, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr
):
    # Per row: the number of logits whose key is >= threshold (int64 keys).
    cols = tl.arange(0, BLOCK_V)
    n = tl.zeros([BLOCK_B], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        m = row_ok[:, None] & (start + cols < vocab_size)[None, :]
        x = tl.load(row_ptr + start + cols[None, :], mask=m, other=float("-inf"))
        n += tl.sum((_key(x) >= threshold[:, None]).to(tl.int32), axis=1)
    return n


@triton.jit
def _mass_at_least(
    row_ptr, row_ok, threshold, row_max, vocab_size, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr
):
    # Per row: the unnormalised probability of the logits whose key is >= threshold.
    cols = tl.arange(0, BLOCK_V)
    mass = tl.zeros([BLOCK_B], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        m = row_ok[:, None] & (start + cols < vocab_size)[None, :]
        x = tl.load(row_ptr + start + cols[None, :], mask=m, other=float("-inf"))
        e = tl.where(_key(x) >= threshold[:, None], tl.exp(x - row_max[:, None]), 0.0)
        mass += tl.sum(e, axis=1)
    return mass


@triton.jit(do_not_specialize=["num_rows"])
def truncate_kernel(
    logits_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    num_rows,
    vocab_size,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < num_rows
    row_ptr = logits_ptr + rows[:, None].to(tl.int64) * vocab_size
    cols = tl.arange(0, BLOCK_V)
    row_max = tl.full([BLOCK_B], float("-inf"), tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        m = row_ok[:, None] & (start + cols < vocab_size)[None, :]
        x = tl.load(row_ptr + start + cols[None, :], mask=m, other=float("-inf"))
        row_max = tl.maximum(row_max, tl.max(x, axis=1))
    row_max = tl.where(row_ok, row_max, 0.0)  # padding rows: no inf - inf below
    # Bisection invariant: lo's key passes (count >= k, mass >= p), hi's fails; 32 halvings
    # close any int32 key interval, so lo ends on the cutoff itself.
    top_key = _key(row_max).to(tl.int64) + 1
    cutoff = tl.full([BLOCK_B], float("-inf"), tl.float32)
    if HAS_MIN_P:
        # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p)
        min_p = tl.load(min_p_ptr + rows, mask=row_ok, other=0.0)
        cutoff = tl.where(min_p > 0.0, row_max + tl.log(tl.where(min_p > 0.0, min_p, 1.0)), cutoff)
    # Rows that keep everything cost no bisection passes unless a tile-mate truncates.
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + rows, mask=row_ok, other=0).to(tl.int32)
        k = tl.where((k <= 0) | (k > vocab_size), vocab_size, k)
        if tl.min(k, axis=0) < vocab_size:
            lo = _key(tl.full([BLOCK_B], float("-inf"), tl.float32)).to(tl.int64)
            hi = top_key
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                ok = _count_at_least(row_ptr, row_ok, mid, vocab_size, BLOCK_B, BLOCK_V) >= k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            cutoff = tl.maximum(cutoff, _unkey(lo))  # after min_p: the higher cutoff wins
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + rows, mask=row_ok, other=1.0)
        if tl.min(p, axis=0) < 1.0:
            lo = _key(cutoff).to(tl.int64)
            total = _mass_at_least(row_ptr, row_ok, lo, row_max, vocab_size, BLOCK_B, BLOCK_V)
            hi = top_key
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                mass = _mass_at_least(row_ptr, row_ok, mid, row_max, vocab_size, BLOCK_B, BLOCK_V)
                ok = mass >= p * total
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid)
            cutoff = tl.where(p < 1.0, _unkey(lo), cutoff)
    if tl.max(cutoff, axis=0) > float("-inf"):
        for start in range(0, vocab_size, BLOCK_V):
            m = row_ok[:, None] & (start + cols < vocab_size)[None, :]
            ptrs = row_ptr + start + cols[None, :]
            x = tl.load(ptrs, mask=m, other=float("-inf"))
            tl.store(ptrs, tl.where(x < cutoff[:, None], float("-inf"), x), mask=m)


@triton.jit(do_not_specialize=["num_rows"])
def gumbel_sample_kernel(
    out_ptr,
    logits_ptr,
    logits_stride,
    temperature_ptr,
    seed_ptr,
    offset_ptr,
    num_rows,
    vocab_size,
    ALL_GREEDY: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < num_rows
    cols = tl.arange(0, BLOCK_V)
    if not ALL_GREEDY:
        is_random = tl.load(temperature_ptr + rows, mask=row_ok, other=0.0) >= _EPS
        # The row's own stream: philox of (seed, offset), then one draw per vocabulary index.
        row_seed = tl.randint(
            tl.load(seed_ptr + rows, mask=row_ok, other=0),
            tl.load(offset_ptr + rows, mask=row_ok, other=0),
        )
        row_seed = tl.broadcast_to(row_seed[:, None], (BLOCK_B, BLOCK_V))
    best = tl.full([BLOCK_B], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_B], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        m = row_ok[:, None] & (start + cols < vocab_size)[None, :]
        x = tl.load(
            logits_ptr + rows[:, None].to(tl.int64) * logits_stride + start + cols[None, :],
            mask=m,
            other=float("-inf"),
        ).to(tl.float32)
        if not ALL_GREEDY:
            bits = tl.randint(row_seed, tl.broadcast_to(start + cols[None, :], (BLOCK_B, BLOCK_V)))
            # u = (j + 1/2) / 2^23 is exact in float32, so 0 < u < 1: tl.rand can round to 1.0,
            # which would give one token in ~3e7 an infinite score.
            u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            x = tl.where(is_random[:, None], x - tl.log(-tl.log(u)), x)
        block_max = tl.max(x, axis=1)
        block_idx = tl.argmax(x, axis=1)
        better = block_max > best  # strict: the first maximum wins, as torch's argmax
        best = tl.where(better, block_max, best)
        best_idx = tl.where(better, start + block_idx, best_idx)
    tl.store(out_ptr + rows, best_idx.to(tl.int64), mask=row_ok)


@triton.jit(do_not_specialize=["num_rows", "num_ids"])
def logprobs_kernel(
    values_ptr,
    ranks_ptr,
    logits_ptr,
    logits_stride,
    ids_ptr,
    num_rows,
    vocab_size,
    num_ids,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < num_rows
    row_ptr = logits_ptr + rows[:, None].to(tl.int64) * logits_stride
    cols = tl.arange(0, BLOCK_V)
    sampled = tl.load(ids_ptr + rows[:, None] * num_ids, mask=row_ok[:, None], other=0)
    sampled_logit = tl.load(row_ptr + sampled, mask=row_ok[:, None], other=0.0).to(tl.float32)
    # Online log-sum-exp; the running max starts finite so padding rows never compute inf - inf.
    run_max = tl.full([BLOCK_B], -3.0e38, tl.float32)
    run_sum = tl.zeros([BLOCK_B], tl.float32)
    rank = tl.zeros([BLOCK_B], tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        m = row_ok[:, None] & (start + cols < vocab_size)[None, :]
        x = tl.load(row_ptr + start + cols[None, :], mask=m, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), axis=1)
        run_max = new_max
        rank += tl.sum((x >= sampled_logit).to(tl.int32), axis=1)
    lse = run_max + tl.log(tl.where(row_ok, run_sum, 1.0))
    k = tl.arange(0, BLOCK_K)
    km = row_ok[:, None] & (k < num_ids)[None, :]
    ids = tl.load(ids_ptr + rows[:, None] * num_ids + k[None, :], mask=km, other=0)
    x = tl.load(row_ptr + ids, mask=km, other=0.0).to(tl.float32)
    tl.store(values_ptr + rows[:, None] * num_ids + k[None, :], x - lse[:, None], mask=km)
    tl.store(ranks_ptr + rows, rank.to(tl.int64), mask=row_ok)
