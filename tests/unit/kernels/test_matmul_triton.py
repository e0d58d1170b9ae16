"""The batch-invariant Triton matmul (kernels/triton/matmul.py, PDSERVE_BATCH_INVARIANT on CUDA):
its torch reference's sums at every tile edge, with bias and float32 logits; a row's bits the
same whatever the rows around it and in either row tile; linear()'s CUDA branch.

Without a GPU the kernel runs in Triton's interpreter, which multiplies in float32 and truncates
casts to bf16: 16-bit outputs are compared within one rounding step."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.linear import linear
from pdserve.kernels.triton.matmul import matmul_torch, matmul_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}


def _operands(
    m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, weight, bias = (
        torch.randn(*shape, generator=gen).to(dtype).to(DEVICE) for shape in ((m, k), (n, k), (n,))
    )
    return x, weight, bias


@pytest.mark.parametrize(
    ("dtype", "m", "n", "k", "bias"),
    [
        (torch.float32, 1, 96, 48, False),  # one row, K under one block
        (torch.float32, 70, 200, 100, True),  # N and K past a tile's edge
        (torch.bfloat16, 130, 64, 160, True),  # a second row tile, K in 2.5 blocks
        (torch.bfloat16, 3, 136, 64, False),
        (torch.float16, 5, 40, 72, True),
    ],
)
def test_matches_reference(dtype: torch.dtype, m: int, n: int, k: int, bias: bool) -> None:
    x, weight, b = _operands(m, n, k, dtype)
    b = b if bias else None
    got = matmul_triton(x, weight, b, dtype)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, matmul_torch(x, weight, b, dtype), **TOLERANCE[dtype])
    # Logits: the float32 sums themselves, never rounded to the weight's dtype.
    logits = matmul_triton(x, weight, b, torch.float32)
    assert logits.dtype == torch.float32
    reference = matmul_torch(x, weight, b, torch.float32)
    torch.testing.assert_close(logits, reference, **TOLERANCE[torch.float32])


def test_leading_dimensions_and_no_rows() -> None:
    x, weight, bias = _operands(6, 24, 40, torch.float32)
    got = matmul_triton(x.view(2, 3, 40), weight, bias, torch.float32)
    assert got.shape == (2, 3, 24)
    assert torch.equal(got.view(6, 24), matmul_triton(x, weight, bias, torch.float32))
    assert matmul_triton(x[:0], weight, bias, torch.float32).shape == (0, 24)


# Batch sizes around the 128-row tile (past 128: a second one).
ROWS = [1, 2, 3, 7, 16, 17, 33, 64, 70, 129, 140]
TILE_ROWS = 128  # matmul_configs.MATMUL_TILES' block_m


def _positions(m: int) -> list[int]:
    """Where the probe sits in a batch of m rows: first and last on a GPU. The interpreter runs
    tl.dot as numpy's sgemm, which rounds a row by its place in the block (OpenBLAS's edge
    kernels): there, the first row of each row tile."""
    if DEVICE.type == "cuda":
        return [0, m - 1]
    return list(range(0, m, TILE_ROWS))


@pytest.mark.parametrize(
    ("dtype", "out_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_rows_do_not_depend_on_the_batch(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    _, weight, bias = _operands(1, 72, 80, dtype)  # N and K past a tile's edge
    probe = _operands(1, 1, 80, dtype, seed=1)[0]
    alone = matmul_triton(probe, weight, bias, out_dtype)[0]
    for m in ROWS:
        x = _operands(m, 1, 80, dtype, seed=m)[0]
        positions = _positions(m)
        x[positions] = probe
        got = matmul_triton(x, weight, bias, out_dtype)
        for row in positions:
            assert torch.equal(got[row], alone), f"{m} rows, the probe at row {row}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="linear()'s CUDA branch")
def test_linear_on_cuda_follows_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    x, weight, bias = _operands(9, 96, 64, torch.bfloat16)
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", "1")
    for out_dtype in (torch.bfloat16, torch.float32):
        got = linear(x, weight, bias, None, out_dtype)
        assert torch.equal(got, matmul_triton(x, weight, bias, out_dtype))
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", "0")
    logits = linear(x, weight, bias, None, torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, matmul_torch(x, weight, bias, torch.float32))
