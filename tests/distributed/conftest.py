"""Fixtures the fault suites share: HF's greedy tokens of any prompt, and a thread pool for
requests that run beside the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.utils.tiny_models import hf_greedy


@pytest.fixture(scope="module")
def reference(tiny_model: Callable[[str], str]) -> Callable[[list[int], int], list[int]]:
    """reference(prompt, max_tokens): the tiny llama's greedy tokens under HF, memoized."""
    model = Path(tiny_model("llama"))
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            (cache[key],) = hf_greedy(model, [prompt], max_tokens)
        return cache[key]

    return greedy


@pytest.fixture
def background() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool
