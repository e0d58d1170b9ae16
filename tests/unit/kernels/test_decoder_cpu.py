"""The native decoder stack (kernels/decoder_cpu.py): a model's layers in one call give the bits
of its layers run one by one (logits and the cache they leave), for the models it takes; the
others, and the batches it does not take, run the layers one by one."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pdserve.kernels.linear import amx_available, pack_linear_weights
from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from tests.utils.paged_batch import build_step, make_kv_cache, run_step
from tests.utils.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not amx_available(), reason="no AMX bf16 tiles on this CPU")


def _models(arch: str, tmp_path: Path):
    path = make_tiny_model(arch, tmp_path / arch)
    source = resolve_model_source(str(path))
    model = load_model(load_hf_config(source), source, torch.bfloat16, "cpu")
    pack_linear_weights(model, 64)
    per_layer = copy.deepcopy(model)
    per_layer.model._stack_checked = True  # never gathered: the layers run one by one
    return model, per_layer


# A short prompt (7 tokens, one chunk), a decode after it, a prompt that fills blocks, and a
# step of three decodes: every step within the stack's batches (<= 128 rows, <= 64 per query).
STEPS = [
    [("a", [5, 9, 2, 7, 11, 3, 4])],
    [("a", [8]), ("b", list(range(20, 60)))],
    [("a", [1]), ("b", [2]), ("c", [3, 4, 5])],
    [("a", [6]), ("b", [7]), ("c", [9])],
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_stack_gives_the_layers_bits(arch: str, tmp_path: Path) -> None:
    model, per_layer = _models(arch, tmp_path)
    kv_stack = make_kv_cache(model.config, dtype=torch.bfloat16)
    kv_layers = make_kv_cache(model.config, dtype=torch.bfloat16)
    with torch.inference_mode():
        for step in STEPS:
            got = run_step(model, kv_stack, step)
            expected = run_step(per_layer, kv_layers, step)
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b)
    assert model.model._stack is not None  # the stack ran
    assert torch.equal(kv_stack.cache, kv_layers.cache)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_models_outside_plain_llama_run_their_layers(arch: str, tmp_path: Path) -> None:
    model, _ = _models(arch, tmp_path)
    with torch.inference_mode():
        run_step(model, make_kv_cache(model.config, dtype=torch.bfloat16), STEPS[0])
    assert model.model._stack is None  # q/k norms (qwen3), an MoE MLP (qwen2_moe)


def test_long_prompts_and_large_batches_run_the_layers(tmp_path: Path) -> None:
    model, _ = _models("llama", tmp_path)
    kv = make_kv_cache(model.config, dtype=torch.bfloat16, num_blocks=256)
    with torch.inference_mode():
        run_step(model, kv, STEPS[0])
        stack = model.model._stack
        assert stack is not None
        hidden = model.model.embed_tokens
        for step in (
            [("x", list(range(100)))],  # a query over 64 tokens: SDPA's prompt path
            [(f"r{i}", [3, 4, 5]) for i in range(43)],  # 129 rows: prefill-sized matmuls
        ):
            input_ids, positions, md = build_step(kv, step)
            assert stack.forward(hidden(input_ids), None, positions, kv.layer_caches, md) is None
