"""Fixtures the distributed tests share: HF's greedy tokens of any prompt, a thread pool for
requests that run beside the test, and a split's instances for the modules that only read them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.utils.pd import start_instance
from tests.utils.server import RemoteServer, start_together
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


@pytest.fixture(scope="session")
def pd_instances(tiny_model: Callable[[str], str]) -> Iterator[dict[str, RemoteServer]]:
    """A prefill, a decode and a plain instance of the tiny llama, started once for the modules
    that share them (test_proxy_paths.py, test_split_params.py, test_pd_split.py): their tests
    send prompts of their own and read the instances' counters as differences."""
    model = tiny_model("llama")
    p, d, plain = start_together(
        lambda: start_instance(model, "kv_producer"),
        lambda: start_instance(model, "kv_consumer"),
        lambda: RemoteServer(["serve", "--model", model, "--dtype", "float32"]),
    )
    with p, d, plain:
        yield {"prefill": p, "decode": d, "plain": plain}
