"""Batch invariance through the engine, both runners, bf16 and float32: probe requests answered
alone and then inside a crowd of requests of random lengths (chunked prefill under a small token
budget, prefix-cache hits on the probes' prompts, up to 200 rows a step) get the same tokens and
bit-identical logprobs (the float32 logits' log-softmax)."""

from __future__ import annotations

import random

import pytest

from pdserve import LLM, SamplingParams

RUNNERS = {"v1": "0", "v2": "1"}


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list:
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
        for n in max_tokens
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


CASES = [
    *[("llama", runner, dtype) for runner in RUNNERS for dtype in ("bfloat16", "float32")],
    # The models with state run on V1: their scans and chunked DeltaNet too.
    *[(arch, "v1", dtype) for arch in ("mamba", "qwen3_5") for dtype in ("bfloat16", "float32")],
]


@pytest.mark.parametrize(("arch", "runner", "dtype"), CASES)
def test_probes_answer_alike_alone_and_in_a_crowd(tiny_model, monkeypatch, arch, runner, dtype):
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[runner])
    rng = random.Random(7)
    # The longest is computed in pieces in the crowd (and by Qwen3.5 as a whole DeltaNet chunk
    # and a recurrent tail).
    probes = [[rng.randrange(4, 500) for _ in range(n)] for n in (5, 23, 61, 150)]
    probe_tokens = 12
    # Prompts of random lengths, some sharing a probe's first blocks (its prefix-cache hits come
    # from them, at whatever length they computed when the probe arrives).
    crowd = []
    for i in range(40):
        n = rng.choice([1, 3, 8, 17, 40, 90])
        head = probes[i % 3][: rng.choice([0, 16, 32])] if i % 4 == 0 else []
        crowd.append(head + [rng.randrange(4, 500) for _ in range(n)])
    with LLM(
        model=tiny_model(arch),
        dtype=dtype,
        max_model_len=256,
        max_num_seqs=64,
        max_num_batched_tokens=200,
    ) as llm:
        alone = [_generate(llm, [p], [probe_tokens])[0] for p in probes]
        # In the crowd the probes also hit the blocks their lone runs left in the cache.
        # The probes at the front, the middle and the back of the crowd.
        prompts = [probes[0], *crowd[:20], probes[1], *crowd[20:30], probes[3], *crowd[30:]]
        prompts.append(probes[2])
        lengths = [probe_tokens if p in probes else rng.randrange(1, 20) for p in prompts]
        together = _generate(llm, prompts, lengths)
    got = [together[prompts.index(p)] for p in probes]
    for i, (a, b) in enumerate(zip(alone, got, strict=True)):
        assert a[0] == b[0], f"probe {i}: tokens"
        assert a[1] == b[1], f"probe {i}: logprobs"
