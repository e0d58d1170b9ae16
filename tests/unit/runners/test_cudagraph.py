"""Runner V2's CUDA-graph buckets and padding, on CPU: which bucket a step gets, what a padded
batch holds, and that padding changes no output (the model runs the padded batch eagerly, as
a replayed graph would). Capture and replay themselves need a GPU (benchmarks/kernels.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.attention import AttentionMetadata
from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from pdserve.runners.inputs import StepInputs
from pdserve.runners.v2 import cudagraph
from pdserve.runners.v2.cudagraph import (
    BatchDescriptor,
    CudaGraphModel,
    StaticInputs,
    batch_descriptors,
    capture_sizes,
    empty_step_inputs,
    select_descriptor,
)
from pdserve.runners.v2.model_runner import ModelRunnerV2
from tests.utils.paged_batch import build_step, make_kv_cache, run_step
from tests.utils.tiny_models import VOCAB_SIZE, hf_greedy, make_tiny_model

MAX_MODEL_LEN, BLOCK_SIZE = 64, 4


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]


def test_batch_descriptors_and_selection() -> None:
    descriptors = batch_descriptors(max_num_seqs=16, max_num_batched_tokens=2048)
    decode = [d.num_tokens for d in descriptors if d.uniform_decode]
    mixed = [d.num_tokens for d in descriptors if not d.uniform_decode]
    assert decode == [1, 2, 4, 8, 16]
    assert mixed[:3] == [2, 4, 8] and mixed[-1] == cudagraph.MAX_MIXED_CAPTURE_TOKENS
    assert select_descriptor(descriptors, 3, max_query_len=1) == BatchDescriptor(4, True)
    assert select_descriptor(descriptors, 16, max_query_len=1) == BatchDescriptor(16, True)
    assert select_descriptor(descriptors, 9, max_query_len=5) == BatchDescriptor(16, False)
    assert select_descriptor(descriptors, 257, max_query_len=200) is None
    assert BatchDescriptor(16, False).max_query_len == 16
    # Mixed buckets stop at the token budget.
    small = batch_descriptors(max_num_seqs=8, max_num_batched_tokens=24)
    assert max(d.num_tokens for d in small if not d.uniform_decode) == 24


def _step(query_lens: list[int], computed: list[int]) -> StepInputs:
    """A step of fake requests: request i has computed[i] cached tokens, in blocks 10i, 10i+1..."""
    ids, positions, slots, query_start_loc = [], [], [], [0]
    for i, (q, c) in enumerate(zip(query_lens, computed)):
        for pos in range(c, c + q):
            ids.append(100 + pos)
            positions.append(pos)
            slots.append((10 * i + pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE)
        query_start_loc.append(query_start_loc[-1] + q)
    seq_lens = [q + c for q, c in zip(query_lens, computed)]
    width = max(seq_lens) // BLOCK_SIZE + 1
    block_table = torch.tensor([[10 * i + b for b in range(width)] for i in range(len(seq_lens))])
    md = AttentionMetadata(
        num_reqs=len(query_lens),
        num_actual_tokens=len(ids),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table.to(torch.int32),
        slot_mapping=torch.tensor(slots),
    )
    return StepInputs(torch.tensor(ids), torch.tensor(positions), md, torch.tensor([0]))


def test_fill_pads_to_a_valid_batch() -> None:
    static = StaticInputs(16, MAX_MODEL_LEN // BLOCK_SIZE, MAX_MODEL_LEN, torch.device("cpu"))
    # A larger step first: the smaller one must not see its leftovers.
    static.fill(_step([5, 6, 3], [0, 9, 2]), BatchDescriptor(16, False))
    step = _step([1, 3], [6, 0])
    padded = static.fill(step, BatchDescriptor(8, False))
    md = padded.attn_metadata
    assert md is static.metadata(BatchDescriptor(8, False))
    assert (md.num_reqs, md.num_actual_tokens, md.max_query_len, md.max_seq_len) == (
        8,
        8,
        8,
        MAX_MODEL_LEN,
    )
    assert padded.input_ids.tolist() == step.input_ids.tolist() + [0] * 4
    assert padded.positions.tolist() == [6, 0, 1, 2, 0, 0, 0, 0]
    assert md.slot_mapping.tolist() == step.attn_metadata.slot_mapping.tolist() + [-1] * 4
    # Four padding requests own one padding token each, the last two none.
    assert md.query_start_loc.tolist() == [0, 1, 4, 5, 6, 7, 8, 8, 8]
    assert md.seq_lens.tolist() == [7, 3, 1, 1, 1, 1, 0, 0]
    width = step.attn_metadata.block_table.shape[1]
    assert torch.equal(md.block_table[:2, :width], step.attn_metadata.block_table)
    assert not md.block_table[:2, width:].any() and not md.block_table[2:].any()
    assert padded.logits_indices is step.logits_indices
    # Capture's input: all padding, each request one token.
    empty = static.fill(empty_step_inputs(torch.device("cpu")), BatchDescriptor(4, True))
    assert empty.attn_metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert empty.attn_metadata.seq_lens.tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("uniform_decode", [True, False], ids=["decode", "mixed"])
def test_padded_step_gives_the_same_logits(tmp_path: Path, uniform_decode: bool) -> None:
    path = make_tiny_model("llama", tmp_path / "llama")
    source = resolve_model_source(str(path))
    model = load_model(load_hf_config(source), source, torch.float32, "cpu")
    kv = make_kv_cache(model.config, num_blocks=64, block_size=BLOCK_SIZE)
    rng = random.Random(0)
    prompts = {
        f"r{i}": [rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for i, n in enumerate([5, 9, 2])
    }
    run_step(model, kv, list(prompts.items()))
    scheduled = [(r, [rng.randrange(3, VOCAB_SIZE)]) for r in prompts]
    if not uniform_decode:  # a new request's prefill chunk beside the decodes
        scheduled.append(("new", [rng.randrange(3, VOCAB_SIZE) for _ in range(6)]))
    input_ids, positions, md = build_step(kv, scheduled)
    logits_indices = md.query_start_loc[1:].long() - 1
    step = StepInputs(input_ids, positions, md, logits_indices)
    padded_kv = kv.cache.clone()
    desc = select_descriptor(batch_descriptors(8, 64), md.num_actual_tokens, md.max_query_len)
    assert desc is not None and desc.num_tokens > md.num_actual_tokens
    static = StaticInputs(
        desc.num_tokens, MAX_MODEL_LEN // BLOCK_SIZE, MAX_MODEL_LEN, torch.device("cpu")
    )
    padded = static.fill(step, desc)
    with torch.inference_mode():
        expected = model(input_ids, positions, kv.layer_caches, md)[logits_indices]
        layer_caches = [padded_kv[:, i] for i in range(padded_kv.shape[1])]
        hidden = model(padded.input_ids, padded.positions, layer_caches, padded.attn_metadata)
    torch.testing.assert_close(hidden[padded.logits_indices], expected, atol=1e-5, rtol=1e-5)
    # Padding tokens write nothing (the cache holds large random values where nobody wrote).
    torch.testing.assert_close(padded_kv, kv.cache, atol=1e-5, rtol=1e-5)


def test_runner_v2_pads_steps_and_matches_hf(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's whole padding path on CPU: capture skipped, so the padded steps run
    eagerly; chunked prefills beside decodes give mixed buckets, the tail decode buckets."""
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr(ModelRunnerV2, "_use_cudagraphs", lambda self: True)
    monkeypatch.setattr(CudaGraphModel, "capture", lambda self, kv_caches: None)
    fills: list[BatchDescriptor] = []
    fill = StaticInputs.fill

    def recording_fill(self: StaticInputs, inputs: StepInputs, desc: BatchDescriptor) -> StepInputs:
        fills.append(desc)
        return fill(self, inputs, desc)

    monkeypatch.setattr(StaticInputs, "fill", recording_fill)
    path = tiny_model("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in (3, 7, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine_args = dict(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16, max_num_seqs=4)
    with LLM(model=path, dtype="float32", **engine_args) as llm:
        assert llm.engine_core.executor.worker.model_runner.cudagraphs is not None
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 5)
    assert any(d.uniform_decode for d in fills) and any(not d.uniform_decode for d in fills)


def test_cpu_never_captures(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1")
    with LLM(model=tiny_model("llama"), dtype="float32", max_model_len=MAX_MODEL_LEN) as llm:
        assert llm.engine_core.executor.worker.model_runner.cudagraphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capture and replay need a GPU")
def test_cuda_graphs_replay_matches_eager_and_hf(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1")
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(
        torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or replay(self)
    )
    path = tiny_model("llama")
    rng = random.Random(2)
    prompts = [[rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in (3, 7, 21, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine_args = dict(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16, max_num_seqs=4)
    tokens = {}
    for eager in (True, False):
        with LLM(model=path, dtype="float32", enforce_eager=eager, **engine_args) as llm:
            assert (llm.engine_core.executor.worker.model_runner.cudagraphs is None) == eager
            requests = [{"prompt_token_ids": p} for p in prompts]
            outputs = llm.generate(requests, params, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in outputs]
    assert replays, "no step replayed a graph"
    assert tokens[False] == tokens[True] == hf_greedy(path, prompts, 8)
