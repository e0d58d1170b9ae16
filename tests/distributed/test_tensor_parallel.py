"""Tensor parallelism over two ranks (gloo, CPU): the model zoo gives HF's logits, and the
engine on the MultiprocExecutor gives HF's greedy tokens."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve import LLM, SamplingParams
from pdserve.distributed import parallel_state
from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from tests.unit.engine.test_correctness import make_prompts, reference, run
from tests.utils.paged_batch import make_kv_cache, run_step
from tests.utils.tiny_models import VOCAB_SIZE, hf_logits, load_hf_model, make_tiny_model

TP_SIZE = 2
ARCHS = ("llama", "qwen3", "opt", "gemma2", "qwen2_moe", "mixtral", "granitemoe", "deepseek_v3")
PROMPTS = {"a": [random.Random(0).randrange(3, VOCAB_SIZE) for _ in range(9)], "b": [5, 6, 7, 8]}
NEXT_TOKENS = {"a": [11], "b": [12]}


def _rank_main(rank: int, init_file: str, model_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP_SIZE
    )
    parallel_state.init_tensor_model_parallel(dist.group.WORLD)
    try:
        for arch in ARCHS:
            source = resolve_model_source(str(Path(model_dir) / arch))
            model = load_model(load_hf_config(source), source, torch.float32, "cpu")
            assert model.lm_head.weight.shape[0] == VOCAB_SIZE // TP_SIZE  # really sharded
            kv = make_kv_cache(model.config, block_size=4)
            prefill = run_step(model, kv, list(PROMPTS.items()))
            decode = run_step(model, kv, list(NEXT_TOKENS.items()))
            torch.save((prefill, decode), Path(model_dir) / f"{arch}.rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_match_hf(tmp_path: Path) -> None:
    for arch in ARCHS:
        make_tiny_model(arch, tmp_path / arch)
    # join=True raises if a rank fails; pytest's timeout bounds a hung collective.
    mp.start_processes(
        _rank_main,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=TP_SIZE,
        start_method="spawn",
    )
    for arch in ARCHS:
        reference = load_hf_model(tmp_path / arch)
        expected = {r: hf_logits(reference, PROMPTS[r] + NEXT_TOKENS[r]) for r in PROMPTS}
        for rank in range(TP_SIZE):
            prefill, decode = torch.load(tmp_path / f"{arch}.rank{rank}.pt")
            for i, req_id in enumerate(PROMPTS):
                n = len(PROMPTS[req_id])
                for got, want in (
                    (prefill[i], expected[req_id][:n]),
                    (decode[i][0], expected[req_id][n]),
                ):
                    torch.testing.assert_close(
                        got, want, atol=1e-4, rtol=0, msg=lambda m, arch=arch: f"{arch}: {m}"
                    )


def test_llm_tp2_matches_hf(tiny_model: Callable[[str], str]) -> None:
    """OPT has as many KV heads as heads: each rank caches its half of them. Prompt logprobs
    come through the sharded LM head's gather and the executor's wire."""
    path = tiny_model("opt")
    with LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        tensor_parallel_size=TP_SIZE,
        distributed_executor_backend="mp",
    ) as llm:
        prompts = make_prompts(VOCAB_SIZE)[::2]
        assert run(llm, prompts) == reference(path, prompts)
        prompt = prompts[1]
        (out,) = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=1, prompt_logprobs=2),
            use_tqdm=False,
        )
    want = hf_logits(load_hf_model(Path(path)), prompt).log_softmax(dim=-1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    for pos, entries in enumerate(out.prompt_logprobs[1:]):
        token, top = prompt[pos + 1], want[pos].topk(2).indices.tolist()
        assert list(entries) == list(dict.fromkeys([token, *top]))
        assert entries[token].rank == int((want[pos] >= want[pos, token]).sum())
        assert entries[token].logprob == pytest.approx(float(want[pos, token]), abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mamba", "qwen3_5"])
def test_state_models_tp2_match_hf(
    tiny_model: Callable[[str], str], arch: str, monkeypatch
) -> None:
    """Mamba's channels and Qwen3.5's DeltaNet heads split over two ranks, each rank keeping
    its share of every request's state in its blocks: HF's greedy tokens, prompts chunked."""
    monkeypatch.delenv("PDSERVE_USE_V2_MODEL_RUNNER", raising=False)
    path = tiny_model(arch)
    with LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        tensor_parallel_size=TP_SIZE,
        distributed_executor_backend="mp",
        max_num_batched_tokens=64,
        max_num_seqs=8,
    ) as llm:
        prompts = make_prompts(VOCAB_SIZE)
        assert run(llm, prompts) == reference(path, prompts)
