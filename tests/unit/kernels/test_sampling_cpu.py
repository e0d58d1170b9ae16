"""The CPU argmax (csrc/sampling_cpu.cpp) against torch's: the first maximum of each row, in
the logits' own dtype, on the shapes and the edge values greedy sampling meets."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.sampling import argmax_cpu, sample_tokens_torch
from pdserve.sampling_params import SamplingParams
from tests.utils.sampling import make_md


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(33, 49_157, generator=gen) * 4).to(dtype)
    logits[3, 100] = logits[3, 40_000] = logits[3].max() + 1  # a tie: the first one wins
    logits[4] = -1.0  # a constant row: index 0
    logits[5, :7] = -float("inf")
    logits[6] = -logits[6].abs() - 1  # all negative
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(argmax_cpu(logits), expected)
    assert expected[3] == 100 and expected[4] == 0


def test_argmax_treats_the_zeros_as_equal_and_reads_strided_rows() -> None:
    logits = torch.full((4, 16), -3.0)
    logits[:, 5] = -0.0
    logits[:, 9] = 0.0
    wide = torch.cat([logits, torch.full((4, 16), 9.0)], dim=1)[:, :16]  # row stride 32
    assert argmax_cpu(wide).tolist() == [5, 5, 5, 5] == wide.argmax(dim=-1).tolist()


def test_argmax_leaves_other_inputs_to_torch() -> None:
    assert argmax_cpu(torch.zeros(2, 8, dtype=torch.float16)) is None
    assert argmax_cpu(torch.zeros(2, 0)) is None
    assert argmax_cpu(torch.zeros(8, 2).t()) is None  # elements of a row not adjacent


def test_greedy_sampling_takes_the_argmax_of_bf16_logits_without_a_copy() -> None:
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1)).bfloat16()
    md = make_md([SamplingParams(temperature=0.0)] * 8, device="cpu")
    assert torch.equal(sample_tokens_torch(logits, md), logits.float().argmax(dim=-1))
