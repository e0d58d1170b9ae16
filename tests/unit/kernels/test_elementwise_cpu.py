"""The C++ RMSNorm, rotary embedding and SiLU-and-mul (csrc/elementwise_cpu.cpp) against their
torch references, in bfloat16: they round where the references round, so they agree bit for
bit, but for SiLU, whose exp may differ from torch's in the last float bit and so round a value
on a bf16 midpoint the other way."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import elementwise as elementwise_cpu
from pdserve.kernels.cpu import native
from pdserve.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from pdserve.kernels.rotary import rotary_embedding_torch

pytestmark = pytest.mark.skipif(
    not native.compiler_available(), reason="no C++ compiler on this machine"
)
BF16 = torch.bfloat16


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


@pytest.mark.parametrize("num_rows", [1, 37, 256])
def test_rms_norm_alone_and_with_residual(num_rows: int) -> None:
    x, residual, weight = _randn(num_rows, 576), _randn(num_rows, 576, seed=1), _randn(576, seed=2)
    out = elementwise_cpu.rms_norm(x, None, weight, 1e-5)
    assert out is not None and torch.equal(out[0], rms_norm_torch(x, weight, 1e-5))
    fused = elementwise_cpu.rms_norm(x, residual, weight, 1e-5)
    expected = fused_add_rms_norm_torch(x, residual, weight, 1e-5)
    assert fused is not None
    assert torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1])


def test_rms_norm_split_over_threads() -> None:
    # Over the kernels' 1M-element threshold. Torch sums the variance in another order at this
    # size, so a few outputs differ from it by one bf16 step.
    x, weight = _randn(2048, 576), _randn(576, seed=2)
    result = elementwise_cpu.rms_norm(x, None, weight, 1e-5)
    assert result is not None
    out, expected = result[0], rms_norm_torch(x, weight, 1e-5)
    torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=2**-7)
    assert (out != expected).float().mean() < 1e-4


def test_rms_norm_of_a_row_with_a_tail() -> None:
    # 40 = two 16-lane vectors and a masked 8.
    x, residual, weight = _randn(3, 40), _randn(3, 40, seed=1), _randn(40, seed=2)
    fused = elementwise_cpu.rms_norm(x, residual, weight, 1e-5)
    expected = fused_add_rms_norm_torch(x, residual, weight, 1e-5)
    assert fused is not None
    assert torch.equal(fused[0], expected[0]) and torch.equal(fused[1], expected[1])


def test_rms_norm_of_strided_heads() -> None:
    # Qwen3's per-head q/k norm: heads sliced out of the fused projection.
    qkv = _randn(5, 6 * 32)
    q = qkv[:, : 4 * 32].unflatten(-1, (4, 32))
    weight = _randn(32, seed=3)
    out = elementwise_cpu.rms_norm(q, None, weight, 1e-6)
    assert out is not None and torch.equal(out[0], rms_norm_torch(q, weight, 1e-6))


# A decode batch on one thread; a prefill, split over the threads at head size 128.
@pytest.mark.parametrize("num_tokens", [9, 1000])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_matches_reference(head_dim: int, num_tokens: int) -> None:
    qkv = _randn(num_tokens, 12 * head_dim)
    query = qkv[:, : 8 * head_dim].unflatten(-1, (8, head_dim))
    key = qkv[:, 8 * head_dim : 10 * head_dim].unflatten(-1, (2, head_dim))
    table = _randn(50, 2, head_dim, seed=4)
    positions = torch.tensor([0, 3, 49, 7, 7, 1, 20, 30, 2] * (num_tokens // 9 + 1))[:num_tokens]
    out = elementwise_cpu.rotary_embedding(positions, query, key, table)
    expected = rotary_embedding_torch(positions, query, key, table)
    assert out is not None
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])


# 1536: whole 16-lane vectors; 100: a masked tail on every row.
@pytest.mark.parametrize(("num_rows", "width"), [(1, 1536), (64, 1536), (1024, 1536), (7, 100)])
@pytest.mark.parametrize(
    ("kernel", "act", "atol", "differing"),
    [
        (elementwise_cpu.silu_and_mul, F.silu, 0.0, 0.01),
        # g * sigmoid(2y) for 0.5 g (1 + tanh(y)): where torch's tanh is -1 exactly the kernel
        # leaves a few 1e-7 times the up projection (an eighth of the elements of large negative gates).
        (
            elementwise_cpu.gelu_tanh_and_mul,
            functools.partial(F.gelu, approximate="tanh"),
            1e-5,
            0.15,
        ),
    ],
    ids=["silu", "gelu_tanh"],
)
def test_act_and_mul_matches_reference(
    num_rows: int, width: int, kernel: Callable, act: Callable, atol: float, differing: float
) -> None:
    x = _randn(num_rows, 2 * width) * 4
    out = kernel(x)
    assert out is not None
    expected = act(x[:, :width]) * x[:, width:]
    # One step of bf16 (2**-8 relative) in the activation, one more in the product.
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=2**-6)
    assert (out != expected).float().mean() < differing


def test_float32_runs_the_kernels_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 too: each row's bits its own whatever the batch (torch's float32 silu and
    sigmoid give a tensor's last elements a scalar exp of other bits); forced torch and other
    dtypes run the references."""
    x = torch.randn(37, 2 * 24) * 4
    alone = torch.cat([elementwise_cpu.silu_and_mul(x[i : i + 1]) for i in range(len(x))])
    torch.testing.assert_close(alone, F.silu(x[:, :24]) * x[:, 24:], atol=1e-6, rtol=1e-5)
    for rows in (2, 3, 5, 17, 37):
        assert torch.equal(elementwise_cpu.silu_and_mul(x[:rows]), alone[:rows])
    gelu = torch.cat([elementwise_cpu.gelu_tanh_and_mul(x[i : i + 1]) for i in range(len(x))])
    torch.testing.assert_close(gelu, F.gelu(x[:, :24], approximate="tanh") * x[:, 24:])
    for rows in (2, 5, 37):
        assert torch.equal(elementwise_cpu.gelu_tanh_and_mul(x[:rows]), gelu[:rows])
    normed, _ = elementwise_cpu.rms_norm(x, None, torch.ones(48), 1e-5)
    torch.testing.assert_close(normed, rms_norm_torch(x, torch.ones(48), 1e-5))
    gate = x[:, :1]
    gated = elementwise_cpu.sigmoid_mul(gate, x)
    torch.testing.assert_close(gated, torch.sigmoid(gate) * x)
    for rows in (2, 3, 9):
        assert torch.equal(elementwise_cpu.sigmoid_mul(gate[:rows], x[:rows]), gated[:rows])
    assert elementwise_cpu.silu_and_mul(x.half()) is None
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "torch")
    assert elementwise_cpu.silu_and_mul(x.to(BF16)) is None


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_deltanet_gates_match_reference_and_keep_each_rows_bits(dtype: torch.dtype) -> None:
    """Qwen3.5's DeltaNet gates: torch's values (softplus's linear branch too), and a row's
    bits the same alone as in any batch (4 heads a row: torch's ops would run a lone row through
    scalar code and a batch's first rows through vector code)."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(37, 4, generator=gen).mul(8).to(dtype) for _ in range(2))
    a_log, dt_bias = torch.randn(4, generator=gen).to(dtype), torch.randn(4, generator=gen)
    a[0, 0] = 30  # softplus is the identity past 20
    g, decay, beta = elementwise_cpu.deltanet_gates(a, b, a_log, dt_bias.to(dtype))
    ref_g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.to(dtype))
    torch.testing.assert_close(g, ref_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decay, ref_g.exp(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        beta, b.sigmoid().float(), atol=1e-2 if dtype == BF16 else 1e-6, rtol=0
    )
    for rows in (1, 2, 17):
        parts = elementwise_cpu.deltanet_gates(a[:rows], b[:rows], a_log, dt_bias.to(dtype))
        assert all(torch.equal(p, full[:rows]) for p, full in zip(parts, (g, decay, beta)))
