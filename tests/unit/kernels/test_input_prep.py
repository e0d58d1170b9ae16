"""Runner V2's input preparation: the Triton kernel against the torch reference, the reference
against inputs built by hand, and the kernel inside runner V2 against HF's greedy tokens."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import fields

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels import input_prep
from pdserve.kernels.input_prep import PreparedInputs, prepare_inputs_torch, prepare_inputs_triton
from pdserve.runners.v2 import model_runner
from tests.utils.tiny_models import VOCAB_SIZE, hf_greedy

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_ROWS, MAX_MODEL_LEN, BLOCK_SIZE = 8, 160, 4
NUM_BLOCKS_PER_REQ = MAX_MODEL_LEN // BLOCK_SIZE


def _state_table(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_token_ids, block_table) with random tokens and shuffled, non-ascending blocks."""
    gen = torch.Generator().manual_seed(seed)
    all_token_ids = torch.randint(3, 1000, (NUM_ROWS, MAX_MODEL_LEN), generator=gen)
    blocks = torch.randperm(NUM_ROWS * NUM_BLOCKS_PER_REQ, generator=gen) + 1  # block 0 is null
    block_table = blocks.view(NUM_ROWS, NUM_BLOCKS_PER_REQ).to(torch.int32)
    return all_token_ids, block_table


def _expected(
    batch: list[tuple[int, int, int]], all_token_ids: torch.Tensor, block_table: torch.Tensor
) -> PreparedInputs:
    """By hand: batch = [(state row, num_computed_tokens, query_len)] in batch order."""
    ids, positions, slots, seq_lens = [], [], [], []
    for row, computed, query_len in batch:
        for pos in range(computed, computed + query_len):
            ids.append(int(all_token_ids[row, pos]))
            positions.append(pos)
            slots.append(int(block_table[row, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
        seq_lens.append(computed + query_len)
    rows = [row for row, _, _ in batch]
    return PreparedInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=block_table[rows],
    )


BATCHES = {
    "decode": [(5, 7, 1), (0, 12, 1), (3, 1, 1)],
    "prefill": [(2, 0, 9), (6, 0, 4), (1, 8, 13)],  # the last one starts after a prefix hit
    "mixed": [(4, 30, 1), (7, 3, 1), (0, 6, 17), (2, 0, 5)],
    # Re-added after preemption: all_token_ids holds prompt + outputs; after a prefix hit of 8
    # tokens the rest is one chunk, ending inside a block.
    "resumed": [(3, 8, 26), (1, 20, 1)],
    "partial_blocks": [(6, 2, 1), (5, 5, 6), (4, 11, 2)],  # none starts or ends on a boundary
    # Longer than the kernel's token tile (128): its token loop runs twice.
    "long_prefill": [(1, 0, 150), (0, 40, 1)],
    "empty": [],
}


def _run(
    fn: Callable[..., PreparedInputs], batch: list[tuple[int, int, int]]
) -> tuple[PreparedInputs, PreparedInputs]:
    """(fn's output, the expected one) for batch = [(state row, computed, query_len)]."""
    all_token_ids, block_table = _state_table()
    num_computed = torch.zeros(NUM_ROWS, dtype=torch.int64)
    for row, computed, _ in batch:
        num_computed[row] = computed
    query_lens = torch.tensor([q for _, _, q in batch], dtype=torch.int32)
    query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    out = fn(
        torch.tensor([row for row, _, _ in batch], dtype=torch.int64).to(DEVICE),
        query_start_loc.to(DEVICE),
        int(query_lens.sum()),
        all_token_ids.to(DEVICE),
        num_computed.to(DEVICE),
        block_table.to(DEVICE),
        BLOCK_SIZE,
    )
    return out, _expected(batch, all_token_ids, block_table)


def _assert_equal(actual: PreparedInputs, expected: PreparedInputs) -> None:
    for f in fields(PreparedInputs):
        a, e = getattr(actual, f.name).cpu(), getattr(expected, f.name)
        assert a.dtype == e.dtype and a.shape == e.shape, f.name
        assert torch.equal(a, e), f.name


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize(
    "fn", [prepare_inputs_torch, prepare_inputs_triton], ids=["torch", "triton"]
)
def test_prepare_inputs(fn: Callable[..., PreparedInputs], name: str) -> None:
    _assert_equal(*_run(fn, BATCHES[name]))


@pytest.mark.parametrize(("forced", "expected"), [("triton", "triton"), ("torch", "torch")])
def test_dispatch_follows_the_backend(
    monkeypatch: pytest.MonkeyPatch, forced: str, expected: str
) -> None:
    called = []
    for name in ("torch", "triton"):
        fn = getattr(input_prep, f"prepare_inputs_{name}")
        monkeypatch.setattr(
            input_prep,
            f"prepare_inputs_{name}",
            lambda *args, fn=fn, name=name: called.append(name) or fn(*args),
        )
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", forced)
    _assert_equal(*_run(input_prep.prepare_inputs, BATCHES["mixed"]))
    assert called == [expected]


def test_runner_v2_with_the_triton_kernel_matches_hf(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunked prefills beside decodes, prefix hits and partial blocks, through the runner."""
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr(model_runner, "prepare_inputs", prepare_inputs_triton)
    path = tiny_model("llama")
    rng = random.Random(0)
    prefix = [rng.randrange(4, VOCAB_SIZE) for _ in range(20)]
    prompts = [prefix + [rng.randrange(4, VOCAB_SIZE) for _ in range(n)] for n in (3, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine_args = dict(max_model_len=64, max_num_batched_tokens=24, max_num_seqs=4)
    with LLM(model=path, dtype="float32", **engine_args) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 6)
