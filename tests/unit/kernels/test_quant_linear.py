"""Linear layers on GGUF-quantized weights (kernels/quant_linear.py), each format (Q4_0, Q4_1,
Q8_0, Q4_K) quantized by the `gguf` package: float32 activations give the bits of the float32 packed
kernel over gguf's dequantized weights; bf16 activations (int8-quantized per 32-k block) stay
within the bound that quantization derives; every row's bits are the same whatever the batch
around it (batch invariance)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pdserve.kernels import quant_linear
from pdserve.kernels.cpu import native
from pdserve.kernels.linear import linear, pack_weight

pytestmark = pytest.mark.skipif(
    not native.compiler_available()
    or not (native.cpu_has("avx512_vnni") and native.cpu_has("avx512_bf16")),
    reason="no C++ compiler, or a CPU without AVX-512 VNNI and BF16",
)

FORMATS = list(quant_linear.QTYPES)
# A panel's tail of features (K of one super-block for Q4_K, whose rows are whole ones of 256);
# K of 48 blocks (6 super-blocks).
CASES = [
    (name, n, 256 if name == "Q4_K" and k == 64 else k)
    for name in FORMATS
    for n, k in [(37, 64), (100, 1536)]
]


def quantized(name: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(the GGUF blocks of a random [n, k] weight, gguf's dequantized float32 weight)."""
    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    if name == "Q4_K":  # `gguf` cannot quantize to it, but any bytes but d's and dmin's are a block
        raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
        scales = rng.uniform(0.001, 0.05, (n, k // 256, 2)).astype(np.float16)
        raw[..., :4] = scales.view(np.uint8)
        raw = raw.reshape(n, -1)
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(n, k))


def test_the_kernel_is_built_where_the_cpu_has_its_instructions() -> None:
    assert quant_linear.available()


@pytest.mark.parametrize(("name", "n", "k"), CASES)
def test_float32_gives_the_dequantized_kernels_bits(name: str, n: int, k: int) -> None:
    raw, dequantized = quantized(name, n, k)
    weight = quant_linear.pack(raw, quant_linear.QTYPES[name], n, k)
    x, bias = torch.randn(9, k), torch.randn(n)
    want = linear(x, dequantized, bias, pack_weight(dequantized))
    assert torch.equal(quant_linear.quant_linear(x, weight, bias), want)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("name", "n", "k"), CASES)
def test_bf16_within_the_bound_of_int8_activations(
    name: str, n: int, k: int, out_dtype: torch.dtype
) -> None:
    """Per block b of a row, xq = round(x / s_b) with s_b = max|x_b| / 127, so each x is off by
    at most s_b / 2 and y by sum_b (s_b / 2) sum_{k in b} |w_k|; then float32 sums over the
    blocks (k * 2^-24 of sum |x w|) and one rounding to bf16 (2^-8 relative; none for float32
    logits)."""
    raw, dequantized = quantized(name, n, k)
    weight = quant_linear.pack(raw, quant_linear.QTYPES[name], n, k)
    x = torch.randn(9, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    got = quant_linear.quant_linear(x, weight, bias, out_dtype)
    assert got.dtype == out_dtype
    got = got.double()
    x64, w64 = x.double(), dequantized.double()
    exact = x64 @ w64.T + bias.double()
    scales = x64.view(9, -1, 32).abs().amax(dim=-1) / 127  # [rows, blocks]
    w_blocks = w64.abs().view(n, -1, 32).sum(dim=-1)  # [n, blocks]
    activation = scales / 2 @ w_blocks.T
    accumulation = k * 2.0**-24 * (x64.abs() @ w64.abs().T)
    rounding = 2.0**-8 if out_dtype == torch.bfloat16 else 0.0
    bound = activation + accumulation + (exact.abs() + activation) * rounding
    assert bool(((got - exact).abs() <= bound).all())
    # The bound is not vacuous: the error is a visible fraction of it.
    assert (got - exact).abs().max() > 0.01 * bound.max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_a_rows_bits_do_not_depend_on_its_batch(name: str, dtype: torch.dtype) -> None:
    n, k = 100, 1536
    raw, _ = quantized(name, n, k, seed=1)
    weight = quant_linear.pack(raw, quant_linear.QTYPES[name], n, k)
    x = torch.randn(70, k).to(dtype)  # past one 64-row sweep and several 8-row register blocks
    batch = quant_linear.quant_linear(x, weight, None)
    for i in (0, 7, 8, 63, 64, 69):
        assert torch.equal(quant_linear.quant_linear(x[i : i + 1], weight, None)[0], batch[i])
        assert torch.equal(quant_linear.quant_linear(x[i:], weight, None)[0], batch[i])


def test_blocks_that_do_not_fill_the_weight_are_refused() -> None:
    raw, _ = quantized("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="in_features=48 is not a multiple of 32"):
        quant_linear.pack(raw, quant_linear.QTYPES["Q4_0"], 4, 48)
    raw, _ = quantized("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="in_features=128 is not a multiple of 256"):
        quant_linear.pack(raw, quant_linear.QTYPES["Q4_K"], 8, 128)
