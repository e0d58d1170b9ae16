"""Triton sampling kernels against the torch reference: processed logits, the sampled
distribution, seeds, greedy rows, logprobs, and the dispatch through the runner's Sampler.

Without a GPU the kernels run in Triton's interpreter (~ms per op per program), so the
statistical tests sample 20k copies of an already processed row, many rows per program."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.sampling import process_logits_torch, topk_logprobs_torch
from pdserve.kernels.triton.sampling import (
    process_logits_triton,
    sample_tokens_triton,
    topk_logprobs_triton,
)
from pdserve.runners.sampler import Sampler
from pdserve.sampling_params import SamplingParams
from tests.utils.sampling import chi_square_p_value, make_md, reference_probs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Deliberately unsorted, so that cutoffs must map back to the right tokens.
LOGITS = torch.tensor([0.7, -1.0, 2.0, 0.3, 1.2, -2.0, 1.5, 0.0, -0.5, 1.0, -1.5, 0.5])
NUM_DRAWS = 20_000
CONFIGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.15),
    SamplingParams(temperature=1.1, top_k=8, top_p=0.9, min_p=0.05),
]


def random_batch(
    batch: int, vocab_size: int, seed: int
) -> tuple[torch.Tensor, list[SamplingParams], list[list[int]], list[list[int]]]:
    """Logits and per-row knobs that exercise every step, greedy rows included."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab_size, generator=gen) * 2
    params = [
        SamplingParams(
            temperature=0.0 if i % 5 == 4 else 0.6 + 0.2 * (i % 4),
            top_k=(0, 7, 40)[i % 3],
            top_p=(1.0, 0.9, 0.5, 0.75)[i % 4],
            min_p=(0.0, 0.02)[i % 2],
            repetition_penalty=(1.0, 1.3, 0.8)[i % 3],
            frequency_penalty=(0.0, 0.4)[i % 2],
            presence_penalty=(0.2, 0.0, -0.3)[i % 3],
        )
        for i in range(batch)
    ]
    outputs = [torch.randint(vocab_size, (i % 9,), generator=gen).tolist() for i in range(batch)]
    prompts = [torch.randint(vocab_size, (5 + i,), generator=gen).tolist() for i in range(batch)]
    return logits, params, outputs, prompts


@pytest.mark.parametrize(
    "batch, vocab_size, dtype",
    # 5000 > the 4096-logit tile: several vocabulary chunks per row.
    [(10, 1000, torch.float32), (10, 1000, torch.bfloat16), (3, 5000, torch.float32)],
)
def test_processed_logits_match_reference(batch: int, vocab_size: int, dtype: torch.dtype) -> None:
    logits, params, outputs, prompts = random_batch(batch, vocab_size, seed=dtype.itemsize)
    md = make_md(params, outputs, prompts, device=DEVICE)
    logits = logits.to(DEVICE, dtype)
    expected = process_logits_torch(logits, md)
    got = process_logits_triton(logits, md)
    kept = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), kept)
    assert (kept.sum(dim=1) < vocab_size // 20).any()  # the masks really cut
    torch.testing.assert_close(got[kept], expected[kept], rtol=1e-6, atol=1e-6)


def test_top_k_top_p_tie_and_minimum_rules() -> None:
    # Tokens tied with the cutoff stay; top-p keeps at least the most likely token.
    logits = torch.tensor(
        [[1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0], [0.1, 0.3, 0.2, -5.0]]
    )
    params = [
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.5),
        SamplingParams(top_p=1e-6),
        SamplingParams(top_p=1e-6),
    ]
    got = process_logits_triton(logits.to(DEVICE), make_md(params, device=DEVICE))
    assert torch.isfinite(got).tolist() == [
        [False, True, True, False],
        [True] * 4,
        [True, False, False, False],
        [False, True, False, False],
    ]


def test_sampled_frequencies_match_processed_softmax() -> None:
    """Each configuration's processed row, copied NUM_DRAWS times and sampled at temperature 1
    in one launch: frequencies follow its softmax, which is the target distribution."""
    processed = []
    for p in CONFIGS:
        row = process_logits_triton(LOGITS[None].to(DEVICE), make_md([p], device=DEVICE))[0]
        target = reference_probs(LOGITS, p)
        assert torch.equal(torch.isfinite(row).cpu(), target > 0), p
        torch.testing.assert_close(row.cpu().double().softmax(dim=-1), target, atol=1e-6, rtol=0)
        processed.append(row)
    logits = torch.stack(processed).repeat(NUM_DRAWS, 1)
    torch.manual_seed(1234)
    md = make_md([SamplingParams(temperature=1.0)] * len(logits), device=DEVICE)
    sampled = sample_tokens_triton(logits, md).cpu()
    for c, p in enumerate(CONFIGS):
        counts = torch.bincount(sampled[c :: len(CONFIGS)], minlength=LOGITS.numel())
        probs = reference_probs(LOGITS, p)
        assert counts[probs == 0].sum() == 0, (p, counts)
        assert chi_square_p_value(counts, probs) > 1e-3, (p, counts, probs * NUM_DRAWS)


def test_sampling_with_every_knob_follows_the_distribution() -> None:
    """End to end on raw logits, fewer draws: truncation runs on every row here."""
    p, n = CONFIGS[-1], 2048
    md = make_md([p] * n, device=DEVICE)
    sampled = sample_tokens_triton(LOGITS.expand(n, -1).to(DEVICE), md).cpu()
    counts = torch.bincount(sampled, minlength=LOGITS.numel())
    probs = reference_probs(LOGITS, p)
    assert counts[probs == 0].sum() == 0
    assert chi_square_p_value(counts, probs) > 1e-3


def test_seeded_draws_follow_the_distribution() -> None:
    """One seeded request at successive output positions samples the right distribution."""
    p, n = SamplingParams(temperature=1.0, seed=99), 5000
    md = make_md([p] * n, device=DEVICE)
    md.output_positions = list(range(n))
    sampled = sample_tokens_triton(LOGITS.expand(n, -1).to(DEVICE), md).cpu()
    counts = torch.bincount(sampled, minlength=LOGITS.numel())
    assert chi_square_p_value(counts, reference_probs(LOGITS, p)) > 1e-3


def _seeded_token(seed: int, position: int, logits_row: torch.Tensor, row: int, batch: int) -> int:
    """A seeded request at `position` as row `row` of a batch with random seeded and unseeded
    company (temperatures, top-k, greedy rows)."""
    company = torch.Generator().manual_seed(batch * 1000 + row + position)
    logits = torch.randn(batch, logits_row.numel(), generator=company)
    logits[row] = logits_row
    params, outputs = [], []
    for i in range(batch):
        kind = i % 4  # 0, 1: unseeded, 2: seeded, 3: greedy
        seed_i = 10_000 + i if kind == 2 else None
        temperature = 0.0 if kind == 3 else 0.5 + kind * 0.5
        params.append(SamplingParams(temperature=temperature, seed=seed_i, top_k=kind * 20))
        outputs.append([0] * (i % 7))
    params[row] = SamplingParams(temperature=1.0, seed=seed)
    outputs[row] = [0] * position
    torch.manual_seed(position * 7 + row)  # the unseeded rows' step seed differs every call
    md = make_md(params, output_token_ids=outputs, device=DEVICE)
    return int(sample_tokens_triton(logits.to(DEVICE), md)[row])


def test_seeded_row_is_independent_of_batch_position_and_company() -> None:
    logits_row = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 0.5
    positions = range(6)
    alone = [_seeded_token(42, pos, logits_row, 0, 1) for pos in positions]
    for row in (0, 13, 31):
        assert [_seeded_token(42, pos, logits_row, row, 32) for pos in positions] == alone, row
    assert len(set(alone)) > 3  # different positions draw differently...
    assert [_seeded_token(43, pos, logits_row, 0, 1) for pos in positions] != alone  # ...seeds too


def test_unseeded_rows_follow_the_default_generator() -> None:
    md = make_md([SamplingParams(temperature=1.0)] * 64, device=DEVICE)
    logits = torch.zeros(64, 256, device=DEVICE)
    draws = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        draws.append(sample_tokens_triton(logits, md))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert len(set(draws[0].tolist())) > 32  # rows of one step draw independently


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(16, 5000, generator=torch.Generator().manual_seed(3))
    logits[::3, 4500] = 50.0  # maxima in the second vocabulary chunk too
    logits = logits.to(DEVICE, dtype)
    greedy = [SamplingParams(temperature=0.0, seed=7)] * 16
    sampled = sample_tokens_triton(logits, make_md(greedy, device=DEVICE))
    assert sampled.dtype == torch.int64
    assert torch.equal(sampled, logits.float().argmax(dim=-1))


def test_greedy_rows_of_a_mixed_batch_take_the_penalized_argmax() -> None:
    logits, params, outputs, prompts = random_batch(10, 1000, seed=3)
    md = make_md(params, outputs, prompts, device=DEVICE)
    sampled = sample_tokens_triton(logits.to(DEVICE), md)
    rows = torch.tensor([p.greedy for p in params], device=DEVICE)
    assert rows.sum() == 2
    expected = process_logits_torch(logits.to(DEVICE), md)[rows].argmax(dim=-1)
    assert torch.equal(sampled[rows], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_logprobs", [0, 5])
def test_logprobs_match_reference(dtype: torch.dtype, num_logprobs: int) -> None:
    gen = torch.Generator().manual_seed(num_logprobs)
    logits = (torch.randn(6, 5000, generator=gen) * 3).to(DEVICE, dtype)
    sampled = torch.randint(5000, (6,), generator=gen).to(DEVICE)
    sampled[0] = logits[0].float().argmax()
    ids, values, ranks = topk_logprobs_triton(logits, sampled, num_logprobs)
    _, ref_values, ref_ranks = topk_logprobs_torch(logits, sampled, num_logprobs)
    assert ids.shape == (6, num_logprobs + 1) and torch.equal(ids[:, 0], sampled)
    assert torch.equal(ranks, ref_ranks) and ranks[0] == 1
    # Each value belongs to its id; with ties at the k-th place the backends may pick different ids.
    raw = logits.float().log_softmax(dim=-1)
    torch.testing.assert_close(values, raw.gather(1, ids), rtol=0, atol=1e-5)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-5)


def test_runner_v2_sampler_dispatches_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host steps (min_tokens), greedy sampling and logprobs through Sampler(use_kernels=True)
    forced to Triton equal the torch Sampler's."""
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    logits, params, outputs, prompts = random_batch(8, 300, seed=11)
    logits = logits.to(DEVICE)
    eos = int(logits[0].argmax())
    params = [
        SamplingParams(
            temperature=0.0, logprobs=3, max_tokens=32, min_tokens=20, repetition_penalty=1.2
        )
        for _ in params
    ]
    md = make_md(params, outputs, prompts, eos_token_ids=[eos] * 8, device=DEVICE)
    got = Sampler(use_kernels=True)(logits, md)
    expected = Sampler(use_kernels=False)(logits, md)
    assert got.sampled_token_ids[0] != eos
    assert torch.equal(got.sampled_token_ids, expected.sampled_token_ids)
    assert got.logprobs.sampled_token_ranks == expected.logprobs.sampled_token_ranks
    torch.testing.assert_close(
        torch.tensor(got.logprobs.logprobs), torch.tensor(expected.logprobs.logprobs)
    )
