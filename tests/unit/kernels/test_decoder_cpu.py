"""The native decoder stack (kernels/cpu/decoder_stack.py): a model's layers in one call give the bits
of its layers run one by one (logits and the cache they leave), for the models it takes; the
others, and the batches it does not take, run the layers one by one."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from pdserve.kernels.cpu import native
from pdserve.kernels.cpu.decoder_stack import DecoderStack
from pdserve.kernels.linear import pack_linear_weights
from pdserve.kernels.quant_linear import QTYPES, QuantWeight
from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from tests.utils.paged_batch import make_kv_cache, run_step
from tests.utils.tiny_models import make_tiny_model

# Skipped only where the CPU lacks the instruction set or no compiler exists: a kernel that fails
# to build must fail here, not fall back to torch unseen.
pytestmark = pytest.mark.skipif(
    not (native.compiler_available() and native.cpu_has("avx512_bf16")),
    reason="no C++ compiler, or no AVX512-BF16 on this CPU",
)


def _models(arch: str, tmp_path: Path):
    path = make_tiny_model(arch, tmp_path / arch)
    source = resolve_model_source(str(path))
    model = load_model(load_hf_config(source), source, torch.bfloat16, "cpu")
    pack_linear_weights(model)
    per_layer = copy.deepcopy(model)
    per_layer.model._stack_checked = True  # never gathered: the layers run one by one
    return model, per_layer


# A short prompt (7 tokens, one chunk), a decode after it, a prompt that fills blocks, a step
# of three decodes, a long prompt and a batch of 129 rows: the stack takes every batch.
STEPS = [
    [("a", [5, 9, 2, 7, 11, 3, 4])],
    [("a", [8]), ("b", list(range(20, 60)))],
    [("a", [1]), ("b", [2]), ("c", [3, 4, 5])],
    [("a", [6]), ("b", [7]), ("c", [9])],
    [("d", list(range(100)))],
    [(f"r{i}", [3, 4, 5]) for i in range(43)],
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_stack_gives_the_layers_bits(arch: str, tmp_path: Path) -> None:
    model, per_layer = _models(arch, tmp_path)
    kv_stack = make_kv_cache(model.config, dtype=torch.bfloat16, num_blocks=256)
    kv_layers = make_kv_cache(model.config, dtype=torch.bfloat16, num_blocks=256)
    with torch.inference_mode():
        for step in STEPS:
            got = run_step(model, kv_stack, step)
            expected = run_step(per_layer, kv_layers, step)
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b)
    assert model.model._stack is not None  # the stack ran
    assert torch.equal(kv_stack.cache, kv_layers.cache)


@pytest.mark.skipif(not native.cpu_has("avx512_vnni"), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize(
    "cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str
)
def test_stack_gives_the_layers_bits_on_gguf_blocks(
    cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default model with its projections kept in Q4_1 blocks (kernels/quant_linear.py),
    over a bf16 or an fp8 KV cache (csrc/fp8.h)."""
    ran = []
    forward = DecoderStack.forward
    monkeypatch.setattr(
        DecoderStack, "forward", lambda *a, **k: ran.append(forward(*a, **k)) or ran[-1]
    )
    source = resolve_model_source(None)
    config = load_hf_config(source)
    kept = tuple(QTYPES.values())
    model = load_model(config, source, torch.bfloat16, "cpu", keep_quantized=kept)
    pack_linear_weights(model)
    assert isinstance(model.model.layers[0].mlp.down_proj.packed_weight, QuantWeight)
    per_layer = copy.deepcopy(model)
    per_layer.model._stack_checked = True
    kv_stack = make_kv_cache(config, dtype=cache_dtype, num_blocks=64)
    kv_layers = make_kv_cache(config, dtype=cache_dtype, num_blocks=64)
    with torch.inference_mode():
        for step in STEPS[:4]:
            for a, b in zip(run_step(model, kv_stack, step), run_step(per_layer, kv_layers, step)):
                assert torch.equal(a, b)
    assert ran and all(out is not None for out in ran)  # the stack took every step
    assert torch.equal(kv_stack.cache.view(torch.uint8), kv_layers.cache.view(torch.uint8))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_models_outside_plain_llama_run_their_layers(arch: str, tmp_path: Path) -> None:
    model, _ = _models(arch, tmp_path)
    with torch.inference_mode():
        run_step(model, make_kv_cache(model.config, dtype=torch.bfloat16), STEPS[0])
    assert model.model._stack is None  # q/k norms (qwen3), an MoE MLP (qwen2_moe)
