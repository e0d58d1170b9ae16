"""x W^T + b with W in its GGUF blocks as the file stores them (Q4_0, Q4_1, Q8_0): the weight
stays 4.5-8.5 bits a weight in GPU memory, and a decode step reads it at that size.

W is `out_features` rows of bytes, K / 32 blocks a row (models/loader/gguf.py keeps them so).
ggml's blocks of 32 weights, each a float16 scale d first:
  Q4_0: d, 16 bytes of 4-bit quants (weights 0..15 the low nibbles, 16..31 the high); d (q - 8)
  Q4_1: d, a float16 minimum m, 16 bytes as Q4_0's; d q + m
  Q8_0: d, 32 int8 quants; d q
Each step of a tile loads BLOCK_K / 32 blocks of BLOCK_N rows, dequantizes them in registers to
the activations' dtype and multiplies with tl.dot into a float32 accumulator.

Batch invariant as triton/matmul.py is: one tile configuration per activation dtype
(`matmul_configs.QUANT_MATMUL_TILES`), persistent programs, every output tile summing K from 0
upwards BLOCK_K at a time, no split-K: a row's result depends on its own row of x alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels.quant_linear import BLOCK, QTYPES, TRITON_QTYPES, GGUFRows, block_bytes
from pdserve.kernels.triton import matmul_configs
from pdserve.kernels.triton.matmul import persistent_launch, tile_offsets

Q4_1, Q8_0 = QTYPES["Q4_1"], QTYPES["Q8_0"]


# The row count is not specialized: one binary serves every batch.
@triton.jit(do_not_specialize=["M"])
def _quant_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,  # the blocks' bytes again, as float16: d (and Q4_1's m) of each block
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    QUANT_BITS: tl.constexpr,  # 4 (Q4_0, Q4_1) or 8 (Q8_0)
    HAS_MIN: tl.constexpr,  # Q4_1: m after d
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tl.static_assert(BLOCK_K % 32 == 0, "a K step covers whole GGUF blocks")
    row_bytes = K // 32 * BLOCK_BYTES
    offs_k = tl.arange(0, BLOCK_K)
    # Where each k of a step sits in its block: the block's index in the step, the quant's byte.
    step_block = offs_k // 32
    if QUANT_BITS == 8:
        quant_byte = 2 + offs_k % 32
    else:
        # Weights j and j + 16 share byte j of the quants, low nibble and high.
        quant_byte = (4 if HAS_MIN else 2) + offs_k % 16
        nibble_shift = offs_k % 32 // 16 * 4
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        offs_m, offs_n = tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        m_valid = offs_m < M
        n_valid = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        rows = offs_n[None, :].to(tl.int64) * row_bytes
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            # Past K and N: zero x and zero scales, so zero products.
            k_valid = offs_k < K - k * BLOCK_K
            w_mask = k_valid[:, None] & n_valid[None, :]
            x = tl.load(x_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
            # [BLOCK_K, BLOCK_N]: each weight's block's first byte (even: blocks are 18, 20, 34).
            block = rows + ((k * (BLOCK_K // 32) + step_block) * BLOCK_BYTES)[:, None]
            d = tl.load(scale_ptr + block // 2, mask=w_mask, other=0.0).to(tl.float32)
            quant = tl.load(w_ptr + block + quant_byte[:, None], mask=w_mask, other=0)
            # gguf's float32 dequantization: one rounding a weight (Q4_1 two, which the GPU's
            # compiler may fuse into one FMA: a float32 step of the weight at most).
            if QUANT_BITS == 8:
                w = d * quant.to(tl.int8, bitcast=True).to(tl.float32)
            else:
                q = (quant.to(tl.int32) >> nibble_shift[:, None]) & 15
                if HAS_MIN:
                    m = tl.load(scale_ptr + block // 2 + 1, mask=w_mask, other=0.0)
                    w = d * q.to(tl.float32) + m.to(tl.float32)
                else:
                    w = d * (q - 8).to(tl.float32)
            w = w.to(x_ptr.dtype.element_ty)
            acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(
            out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :]
        )


def _check(weight: GGUFRows) -> None:
    if weight.qtype not in TRITON_QTYPES:
        raise ValueError(
            f"GGUF type {weight.qtype} has no Triton kernel: it reads {TRITON_QTYPES}."
        )
    if weight.in_features % BLOCK:
        raise ValueError(f"in_features={weight.in_features} is not a multiple of {BLOCK}.")
    row_bytes = weight.in_features // BLOCK * block_bytes(weight.qtype)
    expected = (weight.out_features, row_bytes)
    if weight.data.dtype != torch.uint8 or tuple(weight.data.shape) != expected:
        raise ValueError(
            f"{weight.data.dtype} {tuple(weight.data.shape)}, expected uint8 {expected}"
        )


def quant_matmul_triton(
    x: torch.Tensor, weight: GGUFRows, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """x [..., K] W^T + b in out_dtype (x's, or float32 for logits: the float32 sums never
    rounded to x's dtype); each row's bits are its own whatever the batch."""
    _check(weight)
    n, k = weight.out_features, weight.in_features
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        # The kernel steps from row to row by a row's bytes.
        rows = weight.data.contiguous()
        tiles = matmul_configs.QUANT_MATMUL_TILES[x.dtype]
        grid, constants = persistent_launch(tiles, m, n, x.device, x.dtype)
        _quant_matmul_kernel[grid](
            x2,
            rows,
            rows.view(torch.float16),
            bias if bias is not None else out,
            out,
            m,
            n,
            k,
            x2.stride(0),
            QUANT_BITS=8 if weight.qtype == Q8_0 else 4,
            HAS_MIN=weight.qtype == Q4_1,
            BLOCK_BYTES=block_bytes(weight.qtype),
            HAS_BIAS=bias is not None,
            **constants,
        )
    return out.view(*x.shape[:-1], n)


def dequantize_torch(weight: GGUFRows) -> torch.Tensor:
    """W [out_features, in_features] in float32, with gguf's numerics (gguf.quants'
    dequantize_blocks: the same roundings, in the same order)."""
    _check(weight)
    blocks = weight.data.reshape(weight.out_features, -1, block_bytes(weight.qtype))
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if weight.qtype == Q8_0:
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    else:
        packed = blocks[..., 4:] if weight.qtype == Q4_1 else blocks[..., 2:]
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()
        if weight.qtype == Q4_1:
            w = d * q + blocks[..., 2:4].contiguous().view(torch.float16).float()
        else:
            w = d * (q - 8)
    return w.reshape(weight.out_features, weight.in_features)


def quant_matmul_torch(
    x: torch.Tensor, weight: GGUFRows, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The reference: W dequantized as gguf does and rounded to x's dtype (what the kernel hands
    tl.dot), float32 products and sums, rounded once to out_dtype."""
    w = dequantize_torch(weight).to(x.dtype).float()
    bias32 = None if bias is None else bias.float()
    return F.linear(x.float(), w, bias32).to(out_dtype)
