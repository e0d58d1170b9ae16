"""A batch-invariant matmul, x W^T + b, for CUDA under PDSERVE_BATCH_INVARIANT; after vLLM's
`matmul_persistent` (vllm/model_executor/layers/batch_invariant.py).

cuBLAS picks its kernel by the problem's shape, the number of rows included, and some of its
kernels split K over thread blocks (split-K, stream-K): a row's sums then depend on how many
rows share its batch. Here the tiles are one configuration per dtype
(`matmul_configs.MATMUL_TILES`), and every output tile sums K from 0 upwards, BLOCK_K at a time,
into one float32 accumulator: a row's result depends on its own row of x alone. The kernel is
persistent: min(SMs, tiles) programs walk the output tiles, GROUP_M rows of tiles at a time so
that they share the weight's columns in L2; which program computes a tile does not change it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.kernels.triton import matmul_configs


@triton.jit
def tile_offsets(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile `tile`'s rows and columns, GROUP_M rows of tiles at a time (they share the
    weight's columns in L2); which program computes a tile does not change it."""
    num_m = tl.cdiv(M, BLOCK_M)
    tiles_per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = tile // tiles_per_group * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + tile % tiles_per_group % group_m
    pid_n = tile % tiles_per_group // group_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


# The row count is not specialized: one binary serves every batch.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    offs_k = tl.arange(0, BLOCK_K)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        offs_m, offs_n = tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        m_valid = offs_m < M
        n_valid = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            # Rows and columns past the edges load zeros, which add nothing to the valid ones.
            k_valid = offs_k < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
            acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(
            out_ptrs,
            acc.to(out_ptr.dtype.element_ty),
            mask=m_valid[:, None] & n_valid[None, :],
        )


# tl.dot on 16-bit inputs is wrong in the interpreter (triton#11584), so it multiplies in fp32
# there. The jit decorator picked the interpreter or the compiler from this same knob.
_INTERPRET = bool(triton.knobs.runtime.interpret)
_DOT_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def persistent_launch(
    tiles: matmul_configs.MatmulTiles, m: int, n: int, device: torch.device, dtype: torch.dtype
) -> tuple[tuple[int], dict]:
    """(grid, constants) of a persistent matmul launch: min(SMs, tiles) programs, the tiles'
    sizes, the dot's dtype and precision for inputs of `dtype`."""
    num_tiles = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1  # the interpreter runs programs one after another
    )
    constants = {
        "DOT_DTYPE": tl.float32 if _INTERPRET else _DOT_DTYPES[dtype],
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "BLOCK_M": tiles.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "GROUP_M": tiles.group_m,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }
    return (min(num_sms, num_tiles),), constants


def matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """x [..., K] W^T [K, N] + b [N] in out_dtype (float32 for logits: the float32 sums, never
    rounded to the weight's dtype); each row's bits are its own whatever the batch (Triton)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        tiles = matmul_configs.MATMUL_TILES[weight.dtype]
        grid, constants = persistent_launch(tiles, m, n, x.device, weight.dtype)
        _matmul_kernel[grid](
            x2,
            weight,
            bias if bias is not None else out,
            out,
            m,
            n,
            k,
            *x2.stride(),
            *weight.stride(),
            out.stride(0),
            HAS_BIAS=bias is not None,
            **constants,
        )
    return out.view(*x.shape[:-1], n)


def matmul_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The reference: float32 products and sums (exact products of 16-bit values), rounded once
    to out_dtype."""
    bias32 = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), bias32).to(out_dtype)
