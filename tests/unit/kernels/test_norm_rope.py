"""RMSNorm (alone and fused with the residual add) and rotary embedding: the torch references
bit-exact against HF's modules, the Triton kernels close to the references."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pdserve.kernels.norm import (
    fused_add_rms_norm_torch,
    fused_add_rms_norm_triton,
    rms_norm_torch,
    rms_norm_triton,
)
from pdserve.kernels.rotary import rotary_embedding_torch, rotary_embedding_triton
from pdserve.models.layers.rotary_embedding import get_rope

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6
# Kernel vs reference: the variance sums in another order; in bf16 the interpreter also
# truncates where the GPU rounds, so a value may be off by one bf16 ulp (1/32 at 4).
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 5e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _qkv(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the models make them: strided head views into one projection."""
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = _randn(num_tokens, sum(sizes), dtype=dtype).split(sizes, dim=-1)
    return (
        q.unflatten(-1, (num_heads, head_dim)),
        k.unflatten(-1, (num_kv_heads, head_dim)),
        v.unflatten(-1, (num_kv_heads, head_dim)),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_triton_matches_torch(dtype: torch.dtype) -> None:
    x = _randn(5, 48, dtype=dtype)  # hidden size not a power of two
    weight = 0.5 + _randn(48, dtype=dtype, seed=1).abs()
    _assert_close(rms_norm_triton(x, weight, EPS), rms_norm_torch(x, weight, EPS))
    # Qwen3's per-head q norm: [T, heads, head_dim] rows strided in the qkv projection.
    q, _, _ = _qkv(3, 4, 2, 16, dtype)
    head_weight = weight[:16]
    _assert_close(rms_norm_triton(q, head_weight, EPS), rms_norm_torch(q, head_weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_triton_matches_torch(dtype: torch.dtype) -> None:
    x, residual = _randn(5, 48, dtype=dtype), _randn(5, 48, dtype=dtype, seed=1)
    weight = 0.5 + _randn(48, dtype=dtype, seed=2).abs()
    out, new_residual = fused_add_rms_norm_triton(x, residual, weight, EPS)
    expected_out, expected_residual = fused_add_rms_norm_torch(x, residual, weight, EPS)
    _assert_close(out, expected_out)
    _assert_close(new_residual, expected_residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_torch_is_hf_bit_for_bit(dtype: torch.dtype) -> None:
    hf = LlamaRMSNorm(48, eps=EPS).to(dtype)
    hf.weight.data = 0.5 + _randn(48, dtype=dtype, seed=2).abs().cpu()
    x, residual = _randn(5, 48, dtype=dtype).cpu(), _randn(5, 48, dtype=dtype, seed=1).cpu()
    assert torch.equal(rms_norm_torch(x, hf.weight, EPS), hf(x))
    out, new_residual = fused_add_rms_norm_torch(x, residual, hf.weight, EPS)
    assert torch.equal(new_residual, residual + x) and torch.equal(out, hf(residual + x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: not a power of two
def test_rotary_triton_matches_torch(dtype: torch.dtype, head_dim: int) -> None:
    rope = get_rope(head_dim, {"rope_theta": 10000.0}, 64, dtype).to(DEVICE)
    q, k, _ = _qkv(7, 4, 2, head_dim, dtype)  # GQA 2:1
    positions = torch.tensor([0, 1, 5, 17, 33, 62, 63], device=DEVICE)
    q_out, k_out = rotary_embedding_triton(positions, q, k, rope.cos_sin_cache)
    expected_q, expected_k = rotary_embedding_torch(positions, q, k, rope.cos_sin_cache)
    _assert_close(q_out, expected_q)
    _assert_close(k_out, expected_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_torch_is_hf_bit_for_bit(dtype: torch.dtype) -> None:
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=500000.0,
    )
    hf = LlamaRotaryEmbedding(config)
    rope = get_rope(16, {"rope_theta": 500000.0}, 128, dtype)
    q, k, _ = _qkv(9, 4, 2, 16, dtype)
    q, k = q.cpu(), k.cpu()
    positions = torch.tensor([0, 3, 4, 15, 16, 64, 100, 126, 127])
    cos, sin = hf(q, positions[None])
    expected_q, expected_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    q_out, k_out = rotary_embedding_torch(positions, q, k, rope.cos_sin_cache)
    assert torch.equal(q_out, expected_q[0].transpose(0, 1))
    assert torch.equal(k_out, expected_k[0].transpose(0, 1))


def test_empty_batch() -> None:
    weight = torch.ones(16, device=DEVICE)
    assert rms_norm_triton(torch.zeros(0, 16, device=DEVICE), weight, EPS).shape == (0, 16)
    rope = get_rope(16, {"rope_theta": 10000.0}, 8, torch.float32).to(DEVICE)
    empty = torch.zeros(0, 2, 16, device=DEVICE)
    positions = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    q, k = rotary_embedding_triton(positions, empty, empty, rope.cos_sin_cache)
    assert q.shape == k.shape == (0, 2, 16)
