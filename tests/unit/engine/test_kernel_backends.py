"""The engine on the Triton kernels (interpreter on CPU) and seeded sampling across runners."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.kernels import attention, input_prep, kv_cache, norm, rotary
from tests.unit.engine.test_correctness import RUNNERS, make_prompts, reference

MAX_TOKENS = 8
TORCH_REFERENCES = [
    (attention, "paged_attention_torch"),
    (kv_cache, "write_kv_cache_torch"),
    (norm, "rms_norm_torch"),
    (norm, "fused_add_rms_norm_torch"),
    (rotary, "rotary_embedding_torch"),
    (input_prep, "prepare_inputs_torch"),
]


def _must_not_run(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} ran although PDSERVE_KERNEL_BACKEND=triton")

    return fail


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_matches_hf(tiny_model, monkeypatch, runner, arch):
    """Every kernel family through Triton: attention, KV write, norm, rotary (+ V2 input prep
    and sampling); tokens equal HF's greedy ones."""
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[runner])
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    for module, name in TORCH_REFERENCES:
        monkeypatch.setattr(module, name, _must_not_run(name))
    path = tiny_model(arch)
    with LLM(
        model=path, dtype="float32", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8
    ) as llm:
        prompts = make_prompts(llm.config.model_config.vocab_size)[:4]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [tokens[:MAX_TOKENS] for tokens in reference(path, prompts)]
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_seeded_request_is_independent_of_its_batch(tiny_model, monkeypatch, runner):
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[runner])
    with LLM(model=tiny_model("llama"), dtype="float32", max_model_len=128) as llm:
        seeded = SamplingParams(
            temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True
        )
        alone = llm.generate("Hello there", seeded, use_tqdm=False)[0].outputs[0].token_ids
        others = [
            SamplingParams(
                temperature=0.8, max_tokens=16, seed=i if i % 2 else None, ignore_eos=True
            )
            for i in range(31)
        ]
        prompts = [f"prompt number {i}" for i in range(31)]
        for position in (0, 17, 31):
            batch_prompts = prompts[:position] + ["Hello there"] + prompts[position:]
            batch_params = others[:position] + [seeded] + others[position:]
            outputs = llm.generate(batch_prompts, batch_params, use_tqdm=False)
            assert outputs[position].outputs[0].token_ids == alone
