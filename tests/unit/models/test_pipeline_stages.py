"""Pipeline stages of the model zoo, in one process: each stage holds only its layers, and the
stages run one after another (activations handed on as IntermediateTensors) give HF's logits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pdserve.distributed import parallel_state
from pdserve.distributed.parallel_state import IntermediateTensors, get_pp_indices
from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from tests.utils.paged_batch import PagedKVCache, build_step, make_kv_cache
from tests.utils.tiny_models import hf_logits, load_hf_model, make_tiny_model

NUM_LAYERS = NUM_STAGES = 3  # one layer each: a first, a middle and a last stage
PROMPTS = {"a": [5, 9, 200, 17, 33, 41, 7, 100, 3], "b": [11, 12, 13, 14]}
NEXT_TOKENS = {"a": [21], "b": [22]}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("qwen2", {}),  # tied embeddings: the last stage holds the embedding as its head
    ("opt", {}),
    ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),  # project in and out
    ("qwen2_moe", {}),
    ("mixtral", {}),
    # Three layers: sliding, full, sliding; Gemma's norms and caps on the last stage.
    ("gemma2", {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    ("deepseek_v2", {}),  # a dense first stage, MoE after, the latent cache
]


@pytest.mark.parametrize(
    "num_layers,pp_size,expected",
    [
        (2, 1, [(0, 2)]),
        (2, 2, [(0, 1), (1, 2)]),
        (7, 2, [(0, 4), (4, 7)]),
        # Leftover layers go to the stages before the last, counting back (vLLM's split).
        (5, 3, [(0, 2), (2, 4), (4, 5)]),
        (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),
    ],
)
def test_get_pp_indices(num_layers: int, pp_size: int, expected: list[tuple[int, int]]) -> None:
    assert [get_pp_indices(num_layers, r, pp_size) for r in range(pp_size)] == expected


@pytest.fixture
def load_stages() -> Iterator[Callable[[Path], list[nn.Module]]]:
    """load_stages(path) -> the model of each stage, each built as its rank builds it."""

    def load(path: Path) -> list[nn.Module]:
        source = resolve_model_source(str(path))
        models = []
        for rank in range(NUM_STAGES):
            parallel_state.init_pipeline_model_parallel(range(NUM_STAGES), rank)
            models.append(load_model(load_hf_config(source), source, torch.float32, "cpu"))
        return models

    yield load
    parallel_state.destroy_model_parallel()


@torch.inference_mode()
def _run_stages(
    models: list[nn.Module], kv: PagedKVCache, scheduled: list[tuple[str, list[int]]]
) -> list[torch.Tensor]:
    """One step through every stage; the logits of every scheduled token, per request."""
    input_ids, positions, metadata = build_step(kv, scheduled)
    kv_caches = kv.layer_caches
    intermediate: IntermediateTensors | None = None
    for rank, model in enumerate(models):
        start, end = get_pp_indices(NUM_LAYERS, rank, NUM_STAGES)
        output = model(input_ids, positions, kv_caches[start:end], metadata, intermediate)
        if rank < NUM_STAGES - 1:
            assert isinstance(output, IntermediateTensors)
            # What the next stage receives is a copy in buffers of the shapes it expects.
            intermediate = model.make_empty_intermediate_tensors(
                input_ids.shape[0], torch.float32, torch.device("cpu")
            )
            for name, buffer in intermediate.tensors.items():
                buffer.copy_(output[name])
    logits = models[-1].compute_logits(output)
    return list(logits.split([len(t) for _, t in scheduled]))


@pytest.mark.parametrize(
    "arch,overrides", CASES, ids=[a + "".join(f"-{k}={v}" for k, v in o.items()) for a, o in CASES]
)
def test_stages_match_hf(
    tmp_path: Path,
    load_stages: Callable[[Path], list[nn.Module]],
    arch: str,
    overrides: dict[str, Any],
) -> None:
    path = make_tiny_model(arch, tmp_path / arch, num_hidden_layers=NUM_LAYERS, **overrides)
    # Every stage's layers: made before the stages set this process's pipeline rank.
    kv = make_kv_cache(load_hf_config(resolve_model_source(str(path))), block_size=4)
    models = load_stages(path)
    for rank, model in enumerate(models):
        names = [n for n, _ in model.named_parameters()]
        layers = {int(n.split(".layers.")[1].split(".")[0]) for n in names if ".layers." in n}
        assert layers == {rank}, f"stage {rank} holds layers {layers}"
        holds_head = any(n.startswith("lm_head.") or "embed_tokens" in n for n in names)
        is_end = rank in (0, NUM_STAGES - 1)
        assert holds_head == is_end, f"stage {rank}: embedding or head where it does not belong"

    prefill = _run_stages(models, kv, list(PROMPTS.items()))
    decode = _run_stages(models, kv, list(NEXT_TOKENS.items()))
    reference = load_hf_model(path)
    for i, req_id in enumerate(PROMPTS):
        expected = hf_logits(reference, PROMPTS[req_id] + NEXT_TOKENS[req_id])
        n = len(PROMPTS[req_id])
        torch.testing.assert_close(prefill[i], expected[:n], atol=1e-4, rtol=0)
        torch.testing.assert_close(decode[i][0], expected[n], atol=1e-4, rtol=0)
