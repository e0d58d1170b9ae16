"""Every architecture against HF transformers (fp32) on a tiny random model: a batched prefill
of two prompts, then decode steps fed with HF's greedy tokens, over a shuffled paged KV cache."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from tests.utils.paged_batch import build_step, make_kv_cache, run_step
from tests.utils.tiny_models import VOCAB_SIZE, hf_greedy, hf_logits, load_hf_model, make_tiny_model

ATOL = 1e-4
NUM_DECODE_STEPS = 4

CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("opt", {}),
    # opt-350m's shape: post-block LayerNorm, embeddings projected in and out.
    ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    ("qwen2_moe", {}),
    ("mixtral", {}),
    ("gemma2", {}),
    ("granitemoe", {}),
    ("deepseek_v2", {}),
    # DeepSeek-V2-Lite's routing: plain top-k of the softmax.
    ("deepseek_v2", {"topk_method": "greedy"}),
    ("deepseek_v3", {}),
    # V3 checkpoints that rotate rope pairs rotate-half style.
    ("deepseek_v3", {"rope_interleave": False}),
]


def _case_id(case: tuple[str, dict[str, Any]]) -> str:
    arch, overrides = case
    return arch + "".join(f"-{k}={v}" for k, v in overrides.items())


def _load(path: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    source = resolve_model_source(str(path))
    return load_model(load_hf_config(source), source, dtype, "cpu")


def _prompts(lengths: list[int], seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"req{i}": [rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for i, n in enumerate(lengths)
    }


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_prefill_then_decode_matches_hf(case: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    arch, overrides = case
    path = make_tiny_model(arch, tmp_path / "model", **overrides)
    model = _load(path)
    reference = load_hf_model(path)
    prompts = _prompts([7, 13])
    greedy = dict(
        zip(prompts, hf_greedy(path, list(prompts.values()), NUM_DECODE_STEPS + 1), strict=True)
    )
    # HF's logits at every position of prompt + the greedy tokens fed back.
    expected = {r: hf_logits(reference, prompts[r] + greedy[r][:NUM_DECODE_STEPS]) for r in prompts}
    kv = make_kv_cache(model.config, block_size=4)

    logits = run_step(model, kv, list(prompts.items()))
    for req_id, req_logits in zip(prompts, logits, strict=True):
        n = len(prompts[req_id])
        torch.testing.assert_close(req_logits, expected[req_id][:n], atol=ATOL, rtol=0)
        assert int(req_logits[-1].argmax()) == greedy[req_id][0]

    for step in range(NUM_DECODE_STEPS):
        logits = run_step(model, kv, [(r, [greedy[r][step]]) for r in prompts])
        for req_id, req_logits in zip(prompts, logits, strict=True):
            position = len(prompts[req_id]) + step
            torch.testing.assert_close(req_logits[0], expected[req_id][position], atol=ATOL, rtol=0)
            assert int(req_logits[0].argmax()) == greedy[req_id][step + 1]


def test_chunked_prefill_beside_decode_matches_hf(tmp_path: Path) -> None:
    """A prompt prefilled in two chunks, in the same steps as another request's decodes."""
    path = make_tiny_model("llama", tmp_path / "model")
    model = _load(path)
    reference = load_hf_model(path)
    prompts = _prompts([11, 5], seed=1)
    long_prompt, short_prompt = prompts["req0"], prompts["req1"]
    short_next = hf_greedy(path, [short_prompt], 2)[0]
    kv = make_kv_cache(model.config, block_size=4)

    run_step(model, kv, [("short", short_prompt)])
    first, second = run_step(model, kv, [("long", long_prompt[:6]), ("short", short_next[:1])])
    third, fourth = run_step(model, kv, [("short", short_next[1:2]), ("long", long_prompt[6:])])

    long_expected = hf_logits(reference, long_prompt)
    short_expected = hf_logits(reference, short_prompt + short_next)
    torch.testing.assert_close(first, long_expected[:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(fourth, long_expected[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[0], short_expected[len(short_prompt)], atol=ATOL, rtol=0)
    torch.testing.assert_close(third[0], short_expected[len(short_prompt) + 1], atol=ATOL, rtol=0)


@torch.inference_mode()
def test_padding_tokens_are_ignored(tmp_path: Path) -> None:
    """Batch padding past num_actual_tokens (slot -1) changes nothing and comes back as rows."""
    model = _load(make_tiny_model("qwen3", tmp_path / "model"))
    prompts = _prompts([6, 3])
    expected = torch.cat(run_step(model, make_kv_cache(model.config), list(prompts.items())))

    kv = make_kv_cache(model.config)
    input_ids, positions, metadata = build_step(kv, list(prompts.items()))
    num_pad = 3
    metadata.slot_mapping = torch.cat([metadata.slot_mapping, torch.full((num_pad,), -1)])
    input_ids = torch.cat([input_ids, torch.zeros(num_pad, dtype=input_ids.dtype)])
    positions = torch.cat([positions, torch.zeros(num_pad, dtype=positions.dtype)])
    hidden_states = model(input_ids, positions, kv.layer_caches, metadata)
    assert hidden_states.shape[0] == len(input_ids)
    logits = model.compute_logits(hidden_states[: metadata.num_actual_tokens])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_bfloat16_matches_hf_bfloat16(tmp_path: Path) -> None:
    """bf16 weights and activations (the CPU default where supported) track HF in bf16."""
    path = make_tiny_model("qwen2_moe", tmp_path / "model")
    model = _load(path, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    prompt = _prompts([9])["req0"]
    logits = run_step(model, make_kv_cache(model.config, dtype=torch.bfloat16), [("a", prompt)])[0]
    assert logits.dtype == torch.float32  # the LM head's float32 sums, never rounded to bf16
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    expected = hf_logits(reference, prompt).to(logits.dtype)
    # One bf16 ulp of logits of magnitude ~8 is 0.03.
    torch.testing.assert_close(logits, expected, atol=0.1, rtol=0)


def test_tiny_models_are_deterministic(tmp_path: Path) -> None:
    first = make_tiny_model("mixtral", tmp_path / "first")
    second = make_tiny_model("mixtral", tmp_path / "second")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
