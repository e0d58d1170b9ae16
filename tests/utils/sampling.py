"""Sampling test helpers: metadata from params, the target distribution, a chi-square test."""

from __future__ import annotations

import torch

from pdserve.runners.sampler import LogitsProcessor, SamplingMetadata
from pdserve.sampling_params import SamplingParams


def make_md(
    params: list[SamplingParams],
    output_token_ids: list[list[int]] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
    eos_token_ids: list[int | list[int] | None] | None = None,
    logits_processors: list[list[LogitsProcessor]] | None = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(
        params,
        output_token_ids if output_token_ids is not None else [[] for _ in range(n)],
        prompt_token_ids if prompt_token_ids is not None else [[] for _ in range(n)],
        eos_token_ids if eos_token_ids is not None else [None] * n,
        device,
        logits_processors,
    )


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The target distribution in float64, one step at a time, written independently."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    probs /= probs.sum()
    if p.top_k > 0:
        kth = probs.sort(descending=True).values[p.top_k - 1]
        probs = torch.where(probs < kth, 0.0, probs)
        probs /= probs.sum()
    if p.top_p < 1.0:
        order = probs.argsort(descending=True)
        kept, total = [], 0.0
        for i in order.tolist():
            kept.append(i)
            total += probs[i].item()
            if total >= p.top_p:
                break
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[kept] = True
        probs = torch.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test over the tokens with non-zero probability; survival function of the
    chi-square distribution through the regularized upper incomplete gamma function."""
    support = probs > 0
    expected = probs[support] * counts.sum()
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0).item()
