"""`pdserve export`: the default GGUF model as an HF folder that HF transformers and pdserve load
into the same greedy tokens as pdserve on the GGUF file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.entrypoints.cli import main as cli_main
from pdserve.models.loader import default_model_path, gguf
from pdserve.models.loader.export import export_hf_folder

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a primary color."},
    ],
    [{"role": "user", "content": "Write one sentence about the ocean."}],
]
MAX_TOKENS = 8  # 30 layers on two shared cores: a few tokens are enough to tell weights apart


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf_folder("default", tmp_path_factory.mktemp("export") / "smollm2", "float32")


def _pdserve_greedy(model: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(greedy tokens of each prompt, the chat template of CHATS[0]) from pdserve in fp32."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=model, dtype="float32", max_model_len=256) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        chat_ids = llm.apply_chat_template(CHATS[0])
    return [list(o.outputs[0].token_ids) for o in outputs], chat_ids


@torch.inference_mode()
def _hf_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers' greedy tokens, fp32, one unpadded prompt at a time. With its KV cache,
    unlike tests.utils.tiny_models.hf_greedy: 30 layers without one take a minute here."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        while len(tokens) < MAX_TOKENS:
            out = model(torch.tensor([tokens[-1:]]), cache=out.cache)
            tokens.append(int(out.logits[0, -1].argmax()))
        outputs.append(tokens)
    return outputs


def test_config_carries_the_gguf_hyperparameters(folder: Path) -> None:
    expected = gguf.load_config(default_model_path())
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["LlamaForCausalLM"]
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rope_parameters["rope_theta"] == 1e5 and config.tie_word_embeddings
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_tokenizer_encodes_like_the_gguf_tokenizer(folder: Path) -> None:
    expected = gguf.load_tokenizer(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for chat in CHATS:
        assert tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        ) == expected.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    text = "Hello world! <|im_start|>user\nÇa va? 123"
    assert tokenizer(text).input_ids == expected(text).input_ids
    assert tokenizer.special_tokens_map == expected.special_tokens_map
    assert tokenizer.chat_template == expected.chat_template
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())


def test_greedy_tokens_match_pdserve_on_the_gguf(folder: Path) -> None:
    tokenizer = gguf.load_tokenizer(default_model_path())
    prompts = [
        tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for chat in CHATS
    ]
    expected, gguf_chat_ids = _pdserve_greedy(str(default_model_path()), prompts)
    tokens, chat_ids = _pdserve_greedy(str(folder), prompts)
    assert tokens == expected
    assert chat_ids == gguf_chat_ids == prompts[0]
    assert _hf_greedy(folder, prompts) == expected


def test_cli_writes_bfloat16_weights(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "WARNING")  # the CLI sets it; restored after the test
    output = tmp_path / "bf16"
    assert cli_main(["export", "--output", str(output), "--dtype", "bfloat16"]) == 0
    assert AutoConfig.from_pretrained(output).dtype == torch.bfloat16
    with (
        safe_open(str(output / "model.safetensors"), framework="pt") as bf16,
        safe_open(str(folder / "model.safetensors"), framework="pt") as fp32,
    ):
        assert set(bf16.keys()) == set(fp32.keys())
        assert "lm_head.weight" not in bf16.keys()  # tied to the embeddings
        for name in bf16.keys():
            torch.testing.assert_close(
                bf16.get_tensor(name), fp32.get_tensor(name).to(torch.bfloat16), rtol=0, atol=0
            )


def test_bad_arguments_are_named(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        export_hf_folder("default", tmp_path / "out", "float16")
    with pytest.raises(ValueError, match="already an HF folder"):
        export_hf_folder(str(folder), tmp_path / "out")
    with pytest.raises(ValueError, match="not an empty folder"):
        export_hf_folder("default", folder)
    assert not (tmp_path / "out").exists()
