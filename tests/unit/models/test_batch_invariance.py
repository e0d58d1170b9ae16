"""Batch invariance of the CPU model paths: a request's logits are bit-identical whether it runs
alone, beside other requests of random lengths in batches of 1..200 rows, at any position in the
batch, with its prompt chunked at different budgets, or after a prefix-cache hit of any length.
bf16 and float32; a plain Llama (the native decoder stack), Qwen3 (per-layer calls with q/k
norms) and Qwen2-MoE (experts' varying shares of the batch)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.kernels.linear import pack_linear_weights
from pdserve.models.loader import load_hf_config, load_model, resolve_model_source
from tests.utils.paged_batch import PagedKVCache, make_kv_cache, run_step
from tests.utils.tiny_models import VOCAB_SIZE, make_tiny_model

BLOCK_SIZE = 4
PROMPT_LEN = 37
DECODES = [11, 23, 5]  # fed after the prompt: the probe's decode steps


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma2", "qwen2_moe", "deepseek_v2"])
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_path(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(arch, tmp_path_factory.mktemp(arch))


def _model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    source = resolve_model_source(str(path))
    model = load_model(load_hf_config(source), source, dtype, "cpu")
    pack_linear_weights(model)  # as the runners do
    return model


class Probe:
    """The probe request's logits at its last prompt token and at each decode, over a schedule
    of steps (each step: the probe's chunk, and the other requests around it)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, prompt: list[int]) -> None:
        self.model, self.dtype, self.prompt = model, dtype, prompt
        self.kv: PagedKVCache = make_kv_cache(
            model.config, num_blocks=512, block_size=BLOCK_SIZE, dtype=dtype
        )

    def share_prefix(self, num_tokens: int) -> None:
        """A prefix-cache hit: another request computed the first `num_tokens` (whole blocks),
        and the probe starts from its blocks."""
        run_step(self.model, self.kv, [("cached", self.prompt[:num_tokens])])
        self.kv.block_tables["probe"] = self.kv.block_tables["cached"][: num_tokens // BLOCK_SIZE]
        self.kv.num_computed_tokens["probe"] = num_tokens

    def run(
        self, chunks: list[int], crowd: list[list[tuple[str, list[int]]]], position: int
    ) -> list[torch.Tensor]:
        """`chunks`: the prompt's chunk sizes after any cached prefix; `crowd[i]`: the other
        requests of step i (the decode steps follow the prompt's); the probe at `position`."""
        start = self.kv.num_computed_tokens.get("probe", 0)
        pieces: list[list[int]] = []
        for size in chunks:
            pieces.append(self.prompt[start : start + size])
            start += size
        assert start == len(self.prompt)
        pieces += [[t] for t in DECODES]
        out = []
        for i, piece in enumerate(pieces):
            others = crowd[i] if i < len(crowd) else []
            at = min(position, len(others))
            step = [*others[:at], ("probe", piece), *others[at:]]
            logits = run_step(self.model, self.kv, step)[at]
            if i >= len(chunks) - 1:  # the prompt's last token, then each decode
                out.append(logits[-1])
        return out


def _crowd(rng: random.Random, num_steps: int, rows: int, step: int) -> list[list[tuple]]:
    """Other requests of random lengths, about `rows` rows per step: new prompts and decodes."""
    crowd = []
    for i in range(num_steps):
        others, total = [], 0
        while total < rows:
            n = min(rows - total, rng.choice([1, 1, 1, 2, 7, 16, 40, 90]))
            others.append((f"s{step}-{i}-{len(others)}", _tokens(rng, n)))
            total += n
        crowd.append(others)
    return crowd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_do_not_depend_on_the_batch(arch: str, model_path: Path, dtype: torch.dtype) -> None:
    model = _model(model_path, dtype)
    rng = random.Random(0)
    prompt = _tokens(rng, PROMPT_LEN)
    alone = Probe(model, dtype, prompt).run([PROMPT_LEN], [], 0)
    steps = len(DECODES) + 1
    cases = [
        # (cached prefix, chunk sizes, rows around the probe per step, its position)
        (0, [PROMPT_LEN], 1, 0),
        (0, [PROMPT_LEN], 20, 1),
        (0, [PROMPT_LEN], 163, 3),  # with the probe's 37 rows: 200
        (0, [5, 16, 16], 30, 99),  # chunked, the probe last
        (0, [1, 36], 7, 1),
        (0, [23, 14], 120, 2),
        (8, [PROMPT_LEN - 8], 12, 0),  # a two-block prefix hit
        (32, [PROMPT_LEN - 32], 64, 1),  # most of the prompt cached
        (16, [3, 18], 9, 5),  # a hit, then chunks
    ]
    for n, (cached, chunks, rows, position) in enumerate(cases):
        probe = Probe(model, dtype, prompt)
        if cached:
            probe.share_prefix(cached)
        crowd = _crowd(rng, len(chunks) - 1 + steps, rows, n)
        got = probe.run(chunks, crowd, position)
        for i, (a, b) in enumerate(zip(got, alone, strict=True)):
            assert torch.equal(a, b), f"case {n} {(cached, chunks, rows, position)}, token {i}"
