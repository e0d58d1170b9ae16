"""The matmuls' share of kernels/triton/launch_configs.py: the tiles of the batch-invariant matmul
(triton/matmul.py) and of the GGUF dequantize-matmul (triton/quant_matmul.py), and the
configurations a linear layer launches them in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.quant_linear import BLOCK, TRITON_QTYPES


@dataclass(frozen=True)
class MatmulTiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # rows of tiles that walk the weight's columns together (L2 reuse)
    num_warps: int
    num_stages: int


# The batch-invariant matmul's one configuration per dtype, whatever the shape: vLLM's
# matmul_persistent's (batch_invariant.py). No split-K: a tile sums K in BLOCK_K steps in order.
MATMUL_TILES = {
    torch.bfloat16: MatmulTiles(128, 128, 64, 8, num_warps=8, num_stages=3),
    torch.float16: MatmulTiles(128, 128, 64, 8, num_warps=8, num_stages=3),
    torch.float32: MatmulTiles(128, 128, 32, 8, num_warps=8, num_stages=3),
}
# The dequantize-matmul's, per activation dtype, batch invariant the same way. BLOCK_K is whole
# GGUF blocks. Narrower than MATMUL_TILES': the weight's tiles are dequantized in registers
# beside the accumulator, and a decode step's few rows spread over more tiles of N. Not tuned
# on a GPU yet.
QUANT_MATMUL_TILES = {
    torch.bfloat16: MatmulTiles(64, 64, 64, 8, num_warps=4, num_stages=3),
    torch.float16: MatmulTiles(64, 64, 64, 8, num_warps=4, num_stages=3),
    torch.float32: MatmulTiles(64, 64, 32, 8, num_warps=4, num_stages=3),
}

# The model shapes that come as GGUF files: the loader reads llama's (models/loader/gguf.py).
GGUF_SHAPE_NAMES = (
    "SmolLM2-135M",
    "Llama-3.2-1B",
    "TinyLlama-1.1B",
    "Llama-2-7B",
    "Llama-3-8B",
    "Llama-3-70B",
)


@dataclass(frozen=True)
class MatmulLaunch:
    """The batch-invariant matmul (PDSERVE_BATCH_INVARIANT) of one linear layer's weight."""

    dtype: torch.dtype
    out_features: int
    in_features: int
    bias: bool
    logits: bool  # float32 out (the LM head); else the weight's dtype


@dataclass(frozen=True)
class QuantMatmulLaunch:
    """The dequantize-matmul of one linear layer's weight kept in GGUF blocks of `qtype`."""

    matmul: MatmulLaunch  # the layer's shape and output; its dtype the activations'
    qtype: int


def quant_matmuls(linears: list[MatmulLaunch]) -> list[QuantMatmulLaunch]:
    """`linears` in every format a GPU keeps in blocks, where their K is whole blocks (a
    row-parallel share that would split them is dequantized: models/loader/gguf.py)."""
    return [
        QuantMatmulLaunch(linear, qtype)
        for linear in linears
        if linear.in_features % BLOCK == 0
        for qtype in TRITON_QTYPES
    ]
