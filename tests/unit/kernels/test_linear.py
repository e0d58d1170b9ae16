"""Linear layers with packed weights (kernels/linear.py): what is packed; the AMX kernel one bf16
rounding from the exact product at every batch and shape edge; oneDNN's packing changes no bit
of the results."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import linear as linear_module
from pdserve.kernels.linear import (
    AMX_MAX_ROWS,
    amx_available,
    can_pack,
    linear,
    pack_linear_weights,
    pack_weight,
)
from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from tests.utils.paged_batch import make_kv_cache, run_step
from tests.utils.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(
    not can_pack(torch.empty(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 on this CPU"
)


needs_amx = pytest.mark.skipif(not amx_available(), reason="no AMX bf16 tiles on this CPU")


def _close_to_exact(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias=None) -> bool:
    """Within one bf16 rounding (2^-8 relative) of the exact product plus float32 accumulation's
    error bound over K (which dominates only where the sum cancels to near zero)."""
    x64, w64 = x.double(), weight.double()
    exact = x64 @ w64.T + (bias.double() if bias is not None else 0)
    accumulation = x.shape[-1] * 2.0**-24 * (x64.abs() @ w64.abs().T)
    return bool(((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + accumulation).all())


@needs_amx
@pytest.mark.parametrize(
    ("num_rows", "out_features", "in_features"),
    [
        (1, 96, 48),  # one row; k padded to the 32-k block
        (7, 100, 64),  # features not a multiple of the 32-feature panel
        (17, 960, 576),  # a second tile of one row
        (33, 576, 1536),  # a pass of one row after a full one
        (64, 3072, 576),  # SmolLM2's decode batch
        (AMX_MAX_ROWS, 80, 96),  # the largest batch the kernel runs
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_amx_rounds_the_exact_product_once(
    num_rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(num_rows, in_features, generator=gen).bfloat16()
    packed = pack_weight(weight, 64)
    assert packed.amx
    got = linear(x, weight, b, packed)
    assert got.shape == (num_rows, out_features) and got.dtype == torch.bfloat16
    assert _close_to_exact(got, x, weight, b)


@needs_amx
def test_amx_reads_strided_rows_and_keeps_leading_dims() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 64, generator=gen).bfloat16()
    x = torch.randn(2, 5, 128, generator=gen).bfloat16()[..., ::2]  # strided last dim
    got = linear(x, weight, None, pack_weight(weight, 64))
    assert got.shape == (2, 5, 64)
    assert _close_to_exact(got, x, weight)


@needs_amx
def test_prefill_batches_run_f_linear() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 576, generator=gen).bfloat16()
    x = torch.randn(AMX_MAX_ROWS + 1, 576, generator=gen).bfloat16()
    assert torch.equal(linear(x, weight, None, pack_weight(weight, 64)), F.linear(x, weight))


@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packing_is_bit_identical(
    num_rows: int, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where there is no AMX, oneDNN's packed weights give F.linear's bits."""
    monkeypatch.setattr(linear_module, "amx_available", lambda: False)
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 576, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(num_rows, 576, generator=gen).bfloat16()
    packed = pack_weight(weight, 64)
    assert not packed.amx
    assert torch.equal(linear(x, weight, b, packed), F.linear(x, weight, b))


def test_only_bf16_cpu_weights_are_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not can_pack(torch.empty(1))  # float32 keeps F.linear, bit for bit the reference's
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "torch")
    assert not can_pack(torch.empty(1, dtype=torch.bfloat16))


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)])
def test_packed_model_gives_the_same_logits(
    tie_word_embeddings: bool, amx: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """oneDNN's packing to the bit; AMX's to within bf16 rounding (one ulp of logits ~8 is 0.03)."""
    monkeypatch.setattr(linear_module, "amx_available", lambda: amx)
    path = make_tiny_model("qwen2", tmp_path / "m", tie_word_embeddings=tie_word_embeddings)
    source = resolve_model_source(str(path))
    model = load_model(load_hf_config(source), source, torch.bfloat16, "cpu")
    packed = copy.deepcopy(model)
    # Per layer q/k/v, o, gate/up and down; plus the LM head (the embedding when tied).
    assert pack_linear_weights(packed, 64) == 4 * model.config.num_hidden_layers + 1
    prompt = [("a", [5, 9, 2, 7, 11, 3]), ("b", [8, 1])]
    logits = [
        run_step(m, make_kv_cache(model.config, dtype=torch.bfloat16), prompt)
        for m in (model, packed)
    ]
    for a, b in zip(*logits, strict=True):
        if amx:
            torch.testing.assert_close(a, b, atol=0.1, rtol=0)
        else:
            assert torch.equal(a, b)
