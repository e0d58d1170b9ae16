"""Linear layers with packed weights (kernels/linear.py): what is packed; the kernel one rounding
from the exact product at every batch and shape edge, in bf16 and float32, with float32 logits
out of bf16; every row's bits the same whatever the batch around it (batch invariance)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pdserve.kernels.cpu import native
from pdserve.kernels.linear import can_pack, linear, pack_linear_weights, pack_weight
from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from tests.utils.paged_batch import make_kv_cache, run_step
from tests.utils.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(
    not native.compiler_available(), reason="no C++ compiler on this machine"
)

DTYPES = [torch.bfloat16, torch.float32]


def _close_to_exact(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias=None) -> bool:
    """Within one rounding to got's dtype of the exact product plus float32 accumulation's
    error bound over K (which dominates only where the sum cancels to near zero)."""
    x64, w64 = x.double(), weight.double()
    exact = x64 @ w64.T + (bias.double() if bias is not None else 0)
    accumulation = x.shape[-1] * 2.0**-24 * (x64.abs() @ w64.abs().T)
    rounding = 2.0**-8 if got.dtype == torch.bfloat16 else 2.0**-24
    return bool(((got.double() - exact).abs() <= exact.abs() * rounding + accumulation).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_rows", "out_features", "in_features"),
    [
        (1, 96, 48),  # one row; bf16's k padded to the 32-k block
        (7, 100, 64),  # features not a multiple of the 32-feature panel
        (13, 960, 576),  # a register block of 12 rows and one of 1
        (33, 576, 1536),  # a pass of one row after a full one
        (129, 80, 96),  # a second 128-row chunk
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_rounds_the_exact_product_once(
    dtype: torch.dtype, num_rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    packed = pack_weight(weight)
    got = linear(x, weight, b, packed)
    assert got.shape == (num_rows, out_features) and got.dtype == dtype
    assert _close_to_exact(got, x, weight, b)
    logits = linear(x, weight, b, packed, torch.float32)
    assert logits.dtype == torch.float32 and _close_to_exact(logits, x, weight, b)
    # The float32 output is the sum the bf16 output rounds: no rounding before it.
    assert torch.equal(logits.to(dtype), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Batch invariance: each row alone, in batches of 1..200 rows and at every position gives
    the same bits (oneDNN and MKL change their summation order with the number of rows)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 1536, generator=gen).to(dtype)
    x = torch.randn(260, 1536, generator=gen).to(dtype)
    packed = pack_weight(weight)
    alone = torch.cat([linear(x[i : i + 1], weight, None, packed) for i in range(len(x))])
    for rows in (2, 5, 12, 13, 31, 32, 33, 64, 127, 128, 129, 200):
        for start in (0, 1, 60):
            batch = linear(x[start : start + rows], weight, None, packed)
            assert torch.equal(batch, alone[start : start + rows]), (rows, start)
    with_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, weight, None, packed), alone)
    finally:
        torch.set_num_threads(with_threads)


def test_reads_strided_rows_and_keeps_leading_dims() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 64, generator=gen).bfloat16()
    x = torch.randn(2, 5, 128, generator=gen).bfloat16()[..., ::2]  # strided last dim
    got = linear(x, weight, None, pack_weight(weight))
    assert got.shape == (2, 5, 64)
    assert _close_to_exact(got, x, weight)


def test_cpu_weights_of_both_dtypes_are_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert can_pack(torch.empty(1)) and can_pack(torch.empty(1, dtype=torch.bfloat16))
    assert not can_pack(torch.empty(1, dtype=torch.float16))
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "torch")
    assert not can_pack(torch.empty(1, dtype=torch.bfloat16))


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_packed_model_gives_the_same_logits(tie_word_embeddings: bool, tmp_path: Path) -> None:
    """The packed kernel's logits within bf16 rounding of F.linear's (one ulp of logits ~8 is
    0.03), in float32 either way."""
    path = make_tiny_model("qwen2", tmp_path / "m", tie_word_embeddings=tie_word_embeddings)
    source = resolve_model_source(str(path))
    model = load_model(load_hf_config(source), source, torch.bfloat16, "cpu")
    packed = copy.deepcopy(model)
    # Per layer q/k/v, o, gate/up and down; plus the LM head (the embedding when tied).
    assert pack_linear_weights(packed) == 4 * model.config.num_hidden_layers + 1
    prompt = [("a", [5, 9, 2, 7, 11, 3]), ("b", [8, 1])]
    logits = [
        run_step(m, make_kv_cache(model.config, dtype=torch.bfloat16), prompt)
        for m in (model, packed)
    ]
    for a, b in zip(*logits, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0.1, rtol=0)
