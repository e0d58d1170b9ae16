"""The sampler: greedy, the sampled distribution, penalties, min_tokens, logprobs, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import sampling
from pdserve.kernels.sampling import apply_top_k_top_p, process_logits_torch
from pdserve.runners.sampler import Sampler
from pdserve.sampling_params import SamplingParams
from tests.utils.sampling import chi_square_p_value, make_md, reference_probs

# Deliberately unsorted, so that masks computed on sorted values must map back correctly.
LOGITS = torch.tensor([0.7, -1.0, 2.0, 0.3, 1.2, -2.0, 1.5, 0.0, -0.5, 1.0, -1.5, 0.5])
NUM_DRAWS = 20_000


def test_chi_square_helper_rejects_a_wrong_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert chi_square_p_value(torch.tensor([5000, 3000, 2000]), probs) > 0.99
    assert chi_square_p_value(torch.tensor([5200, 2900, 1900]), probs) < 1e-3


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=7)] * 16
    out = Sampler(use_kernels=False)(logits, make_md(params))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None
    # bf16 logits: the argmax of their float32 values.
    bf16 = logits.bfloat16()
    out = Sampler(use_kernels=False)(bf16, make_md(params))
    assert torch.equal(out.sampled_token_ids, bf16.float().argmax(dim=-1))


@pytest.mark.parametrize("use_kernels", [False, True])
def test_a_temperature_past_float32_samples_only_allowed_tokens(use_kernels: bool) -> None:
    """A temperature of 1.8e308 (a valid JSON number) is inf in float32, and a masked logit
    over inf was NaN, which the sampler took: a grammar's -inf tokens came out (found through
    the proxy by schemathesis). The masked tokens stay out; the rest are equally likely."""
    logits = LOGITS.repeat(4, 1)
    logits[:, ::2] = float("-inf")  # what a grammar's bitmask leaves
    params = [SamplingParams(temperature=1.7976931348623157e308)] * 4
    for _ in range(20):
        sampled = Sampler(use_kernels=use_kernels)(logits.clone(), make_md(params))
        assert (sampled.sampled_token_ids % 2 == 1).all(), sampled.sampled_token_ids


def test_mixed_batch_greedy_rows_take_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 200)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=50) for i in range(8)]
    md = make_md(params)
    assert not md.all_greedy and not md.all_random
    for _ in range(5):
        sampled = Sampler(use_kernels=False)(logits, md).sampled_token_ids
        assert torch.equal(sampled[1::2], logits[1::2].argmax(dim=-1))


CONFIGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.15),
    SamplingParams(temperature=1.1, top_k=8, top_p=0.9, min_p=0.05),
]


def test_sampled_frequencies_match_processed_softmax():
    """20k draws per configuration, all configurations interleaved in one batch."""
    torch.manual_seed(1234)
    num_configs = len(CONFIGS)
    params = CONFIGS * NUM_DRAWS
    logits = LOGITS.expand(len(params), -1)
    sampled = Sampler(use_kernels=False)(logits, make_md(params)).sampled_token_ids
    vocab_size = LOGITS.numel()
    for c, p in enumerate(CONFIGS):
        counts = torch.bincount(sampled[c::num_configs], minlength=vocab_size)
        probs = reference_probs(LOGITS, p)
        # Tokens cut by top-k / top-p / min-p never appear.
        assert counts[probs == 0].sum() == 0, (p, counts, probs)
        p_value = chi_square_p_value(counts, probs)
        assert p_value > 1e-3, (p, p_value, counts, probs * NUM_DRAWS)


def test_seeded_draws_follow_the_distribution():
    """A seeded request at successive positions samples the right distribution too."""
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=99)
    n = 5000
    md = make_md([p] * n)
    md.output_positions = list(range(n))  # one request, n consecutive steps
    sampled = Sampler(use_kernels=False)(LOGITS.expand(n, -1), md).sampled_token_ids
    counts = torch.bincount(sampled, minlength=LOGITS.numel())
    probs = reference_probs(LOGITS, p)
    assert counts[probs == 0].sum() == 0
    assert chi_square_p_value(counts, probs) > 1e-3


def test_top_k_top_p_mask_matches_reference_on_a_large_vocab():
    torch.manual_seed(3)
    logits = torch.randn(6, 50_000) * 3
    top_k = torch.tensor([0, 40, 0, 1000, 5, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 1.0])
    masked = apply_top_k_top_p(logits.clone(), top_k, top_p)
    for i in range(6):
        p = SamplingParams(top_k=int(top_k[i]), top_p=float(top_p[i]))
        expected = reference_probs(logits[i], p) > 0
        assert torch.equal(torch.isfinite(masked[i]), expected), i
        assert torch.equal(masked[i][expected], logits[i][expected])


def test_top_p_keeps_at_least_one_token():
    logits = torch.tensor([[10.0, 0.0, 0.0], [0.1, 0.3, 0.2]])
    masked = apply_top_k_top_p(logits.clone(), None, torch.tensor([1e-6, 1e-6]))
    assert torch.isfinite(masked).tolist() == [[True, False, False], [False, True, False]]


def test_tokens_tied_with_the_cutoff_stay():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    masked = apply_top_k_top_p(logits.clone(), torch.tensor([1, 0]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(masked).tolist() == [[False, True, True, False], [True] * 4]


def test_penalties_exact_values():
    logits = torch.tensor(
        [
            [1.0, -1.0, 2.0, -2.0, 0.5, 0.0, 3.0, -0.5],
            [1.0, -1.0, 2.0, -2.0, 0.5, 0.0, 3.0, -0.5],
            [1.0, -1.0, 2.0, -2.0, 0.5, 0.0, 3.0, -0.5],
        ]
    )
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),  # no penalty: untouched although it has tokens
        SamplingParams(repetition_penalty=0.5),
    ]
    prompts = [[0, 1], [0, 1, 2], [1, 6]]
    outputs = [[2, 2, 3, 0], [3, 3], [3]]
    md = make_md(params, output_token_ids=outputs, prompt_token_ids=prompts)
    processed = process_logits_torch(logits, md)
    expected = logits.clone()
    # Row 0. Token 0: prompt and output once; 1: prompt only; 2: output twice; 3: output once.
    expected[0, 0] = 1.0 / 2 - 0.5 * 1 - 0.25
    expected[0, 1] = -1.0 * 2
    expected[0, 2] = 2.0 / 2 - 0.5 * 2 - 0.25
    expected[0, 3] = -2.0 * 2 - 0.5 * 1 - 0.25
    # Row 2: repetition 0.5 on tokens 1, 6 (prompt) and 3 (output).
    expected[2, 1] = -1.0 * 0.5
    expected[2, 6] = 3.0 / 0.5
    expected[2, 3] = -2.0 * 0.5
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-6)
    assert not torch.equal(processed, logits), "the caller's logits must not be mutated"


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    md = make_md([SamplingParams(temperature=0.0, presence_penalty=0.5)], output_token_ids=[[1]])
    assert Sampler(use_kernels=False)(logits, md).sampled_token_ids.tolist() == [2]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop = 5, 7
    logits = torch.zeros(1, 10)
    logits[0, eos], logits[0, stop], logits[0, 2] = 10.0, 9.0, 1.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    for generated, expected in [(0, 2), (2, 2), (3, eos)]:
        md = make_md([p], output_token_ids=[[1] * generated], eos_token_ids=[eos])
        assert md.min_tokens_blocked == ({0: [stop, eos]} if generated < 3 else {})
        assert Sampler(use_kernels=False)(logits, md).sampled_token_ids.tolist() == [expected]
    # Several EOS ids per row are all blocked.
    md = make_md([p], output_token_ids=[[]], eos_token_ids=[[eos, 2]])
    assert md.min_tokens_blocked == {0: [stop, eos, 2]}
    assert Sampler(use_kernels=False)(logits, md).sampled_token_ids.tolist() == [0]
    # A random row never samples a blocked token either; other rows are not affected.
    torch.manual_seed(0)
    random_p = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[stop])
    params = [random_p, SamplingParams(temperature=1.0)] * 500
    outputs = [[] for _ in params]
    md = make_md(params, output_token_ids=outputs, eos_token_ids=[eos] * len(params))
    sampled = Sampler(use_kernels=False)(logits.expand(len(params), -1), md).sampled_token_ids
    assert not torch.isin(sampled[0::2], torch.tensor([eos, stop])).any()
    assert (sampled[1::2] == eos).float().mean() > 0.5


def test_logprobs_are_raw_with_sampled_token_first():
    torch.manual_seed(0)
    vocab_size = 100
    logits = torch.randn(4, vocab_size) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, top_k=10, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=1.5, top_p=0.5, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    md = make_md(params, output_token_ids=[[1], [2, 3], [], [4]], prompt_token_ids=[[0]] * 4)
    assert md.max_num_logprobs == 5
    out = Sampler(use_kernels=False)(logits, md)
    lp = out.logprobs
    assert lp is not None
    assert [len(row) for row in lp.logprob_token_ids] == [6] * 4
    assert [len(row) for row in lp.logprobs] == [6] * 4
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids.tolist()
    for i in range(4):
        ids = lp.logprob_token_ids[i]
        assert ids[0] == sampled[i]
        assert ids[1:] == raw[i].topk(5).indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.logprobs[i]), raw[i, ids])
        assert lp.sampled_token_ranks[i] == 1 + int((raw[i] > raw[i, sampled[i]]).sum())
    assert lp.sampled_token_ranks[0] == 1  # greedy picks the most likely raw token


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler(use_kernels=False)(logits, make_md([SamplingParams(temperature=0.0, logprobs=0)]))
    assert out.logprobs.logprob_token_ids == [[2]]
    assert out.logprobs.sampled_token_ranks == [1]


def _seeded_steps(seed: int, position: int, logits_row: torch.Tensor, row: int, batch: int):
    """Samples a seeded request at `position` as row `row` of a batch with seeded and unseeded
    company whose logits and parameters are random."""
    company = torch.Generator().manual_seed(batch * 1000 + row + position)
    logits = torch.randn(batch, logits_row.numel(), generator=company)
    logits[row] = logits_row
    params, outputs = [], []
    for i in range(batch):
        kind = i % 3
        seed_i = None if kind == 0 else 10_000 + i
        params.append(SamplingParams(temperature=0.5 + kind * 0.5, seed=seed_i, top_k=kind * 20))
        outputs.append([0] * (i % 7))
    params[row] = SamplingParams(temperature=1.0, seed=seed)
    outputs[row] = [0] * position
    torch.manual_seed(position * 7 + row)  # the default generator differs every call
    md = make_md(params, output_token_ids=outputs)
    return Sampler(use_kernels=False)(logits, md).sampled_token_ids[row]


def test_seeded_row_is_independent_of_batch_position_and_company():
    torch.manual_seed(0)
    logits_row = torch.randn(1000) * 0.5
    positions = list(range(12))
    alone = [int(_seeded_steps(42, pos, logits_row, 0, 1)) for pos in positions]
    for row in (0, 13, 31):
        in_batch = [int(_seeded_steps(42, pos, logits_row, row, 32)) for pos in positions]
        assert in_batch == alone, row
    # Different positions draw differently, and so does a different seed.
    assert len(set(alone)) > 6
    other_seed = [int(_seeded_steps(43, pos, logits_row, 0, 1)) for pos in positions]
    assert other_seed != alone


def test_only_the_kernel_sampler_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runner V1's Sampler(use_kernels=False) stays on the torch reference even when the
    kernel backend is forced to Triton; runner V2's dispatches."""
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")

    def dispatched(*args: object) -> None:
        raise RuntimeError("dispatched to Triton")

    monkeypatch.setattr(sampling, "sample_tokens_triton", dispatched)
    monkeypatch.setattr(sampling, "topk_logprobs_triton", dispatched)
    md = make_md([SamplingParams(temperature=1.0, logprobs=2)])
    out = Sampler(use_kernels=False)(LOGITS[None], md)
    assert out.logprobs.logprob_token_ids[0][0] == out.sampled_token_ids[0]
    with pytest.raises(RuntimeError, match="dispatched to Triton"):
        Sampler(use_kernels=True)(LOGITS[None], md)


def test_logits_processors_are_applied_per_row():
    calls = []

    def ban_top(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        calls.append(list(output_token_ids))
        row[row.argmax()] = float("-inf")
        return row

    def boost(output_token_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        return row + torch.nn.functional.one_hot(torch.tensor(len(output_token_ids)), 6) * 100

    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 0.0, 0.0]] * 3)
    params = [SamplingParams(temperature=0.0)] * 3
    outputs = [[4, 4], [1], [1, 2, 3]]
    md = make_md(params, output_token_ids=outputs, logits_processors=[[ban_top], [], [boost]])
    sampled = Sampler(use_kernels=False)(logits, md).sampled_token_ids.tolist()
    assert sampled == [3, 2, 3]
    assert calls == [[4, 4]]
    assert logits[0, 2] == 5.0, "the caller's logits must not be mutated"


def test_metadata_leaves_unused_knobs_off():
    md = make_md([SamplingParams(temperature=0.0, top_k=5), SamplingParams(seed=3)])
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.repetition_penalties is None and md.prompt_token_ids is None
    assert md.max_num_logprobs is None and md.logits_processors is None
    assert md.seeds == [None, 3] and md.output_positions == [0, 0]
    md = make_md([SamplingParams(top_k=5, top_p=0.5, min_p=0.1, frequency_penalty=0.1)])
    assert md.top_k.tolist() == [5] and md.top_p.tolist() == [0.5]
    assert md.min_p.tolist() == [pytest.approx(0.1)]
    assert md.frequency_penalties.tolist() == [pytest.approx(0.1)]
    assert md.prompt_token_ids == [[]]


def test_large_batch_runs_all_knobs():
    """B=256, V=50k with every knob on: finite, in range, and greedy rows exact."""
    torch.manual_seed(0)
    batch, vocab_size = 256, 50_000
    logits = torch.randn(batch, vocab_size)
    params = [
        SamplingParams(
            temperature=0.0 if i % 4 == 0 else 0.8,
            top_k=(i % 3) * 50,
            top_p=0.9 if i % 2 else 1.0,
            min_p=0.01 if i % 5 == 0 else 0.0,
            repetition_penalty=1.1,
            seed=i if i % 3 == 0 else None,
            logprobs=5,
        )
        for i in range(batch)
    ]
    outputs = [[(i * 7 + j) % vocab_size for j in range(50)] for i in range(batch)]
    prompts = [[(i * 13 + j) % vocab_size for j in range(200)] for i in range(batch)]
    md = make_md(params, output_token_ids=outputs, prompt_token_ids=prompts)
    out = Sampler(use_kernels=False)(logits, md)
    sampled = out.sampled_token_ids
    assert sampled.shape == (batch,) and bool(((sampled >= 0) & (sampled < vocab_size)).all())
    processed = process_logits_torch(logits, md)
    assert torch.equal(sampled[0::4], processed[0::4].argmax(dim=-1))
    assert all(math.isfinite(v) for row in out.logprobs.logprobs for v in row)
