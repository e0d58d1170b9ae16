"""Linear layers with weights packed for oneDNN (kernels/linear.py): what is packed, and that
packing changes no bit of the results."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.linear import can_pack, linear, pack_linear_weights, pack_weight
from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from tests.utils.paged_batch import make_kv_cache, run_step
from tests.utils.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(
    not can_pack(torch.empty(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 on this CPU"
)


@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_is_bit_identical(num_rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 48, generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16() if bias else None
    x = torch.randn(num_rows, 48, generator=gen).bfloat16()
    packed = pack_weight(weight, 64)
    assert torch.equal(linear(x, weight, b, packed), F.linear(x, weight, b))


def test_only_bf16_cpu_weights_are_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not can_pack(torch.empty(1))  # float32 keeps F.linear, bit for bit the reference's
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "torch")
    assert not can_pack(torch.empty(1, dtype=torch.bfloat16))


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_packed_model_gives_the_same_logits(tie_word_embeddings: bool, tmp_path: Path) -> None:
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
        assert torch.equal(a, b)
