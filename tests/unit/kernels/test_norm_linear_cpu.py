"""The fused norm + q/k/v and norm + gated MLP calls (kernels/cpu/norm_linear.py): the same bits
as their steps run one by one, and the steps one by one wherever they do not apply."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu import native
from pdserve.kernels.cpu.norm_linear import norm_linear, norm_mlp
from pdserve.kernels.linear import pack_linear_weights
from pdserve.models.layers.decoder import GatedMLP
from pdserve.models.layers.layernorm import RMSNorm

# Skipped only where the CPU lacks the instruction set or no compiler exists: a kernel that fails
# to build must fail here, not fall back to torch unseen.
pytestmark = pytest.mark.skipif(
    not (native.compiler_available() and native.cpu_has("avx512_bf16")),
    reason="no C++ compiler, or no AVX512-BF16 on this CPU",
)


def _layer(hidden: int, intermediate: int, bias: bool, seed: int) -> tuple[RMSNorm, GatedMLP]:
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5, torch.bfloat16)
    mlp = GatedMLP(hidden, intermediate, "silu", bias, torch.bfloat16)
    for p in (*norm.parameters(), *mlp.parameters()):
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1 if p.dim() == 1 else 0))
    return norm, mlp


def _inputs(rows: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, hidden, generator=gen).bfloat16() for _ in range(2))


@pytest.mark.parametrize("rows", [1, 17, 64, 129])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_gives_the_steps_bits(rows: int, bias: bool) -> None:
    norm, mlp = _layer(128, 96, bias, seed=rows)
    assert pack_linear_weights(mlp) == 2
    x, residual = _inputs(rows, 128, seed=rows)
    with torch.inference_mode():
        normed, expected_residual = norm(x, residual)
        expected = mlp(normed)
        out, residual_out = mlp.forward_after_norm(norm, x, residual)
    assert torch.equal(residual_out, expected_residual)
    assert torch.equal(out, expected)


def _fused(norm: RMSNorm, mlp: GatedMLP, x: torch.Tensor, residual: torch.Tensor):
    return norm_mlp(
        x,
        residual,
        norm.weight,
        norm.variance_epsilon,
        mlp.gate_up_proj.packed_weight,
        mlp.gate_up_proj.bias,
        mlp.down_proj.packed_weight,
        mlp.down_proj.bias,
    )


def test_applies_to_packed_bf16_rows_only() -> None:
    norm, mlp = _layer(64, 96, False, seed=0)
    x, residual = _inputs(8, 64, seed=0)
    assert _fused(norm, mlp, x, residual) is None  # weights not packed
    pack_linear_weights(mlp)
    assert _fused(norm, mlp, x, residual) is not None
    assert _fused(norm, mlp, *_inputs(300, 64, seed=1)) is not None  # prefill-sized too
    assert _fused(norm, mlp, x.float(), residual.float()) is None
    assert _fused(norm, mlp, x[:, ::2], residual[:, ::2]) is None  # strided features


def test_hidden_sizes_off_the_k_block_run_the_steps() -> None:
    norm, mlp = _layer(48, 96, False, seed=2)
    pack_linear_weights(mlp)
    x, residual = _inputs(5, 48, seed=2)
    assert _fused(norm, mlp, x, residual) is None
    with torch.inference_mode():
        normed, expected_residual = norm(x, residual)
        out, residual_out = mlp.forward_after_norm(norm, x, residual)
    assert torch.equal(out, mlp(normed)) and torch.equal(residual_out, expected_residual)


@pytest.mark.parametrize("rows", [1, 33, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_linear_gives_the_steps_bits(rows: int, with_residual: bool) -> None:
    norm, mlp = _layer(96, 64, True, seed=rows)
    proj = mlp.gate_up_proj  # a linear of the hidden states, with a bias
    pack_linear_weights(mlp)
    x, residual = _inputs(rows, 96, seed=rows)
    residual = residual if with_residual else None
    fused = norm_linear(
        x, residual, norm.weight, norm.variance_epsilon, proj.packed_weight, proj.bias
    )
    assert fused is not None
    with torch.inference_mode():
        normed, expected_residual = norm(x, residual) if residual is not None else (norm(x), x)
    assert torch.equal(fused[0], proj(normed))
    assert torch.equal(fused[1], expected_residual)
