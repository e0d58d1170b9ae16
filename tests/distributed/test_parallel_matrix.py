"""The parallel layouts token for token against HF: TP=2, PP=2 and TP=2 x PP=2, on the mp and ray
executors, runner V1 and V2, async scheduling on and off, a dense and a MoE model.

Every cell starts 2-4 worker processes: the cells cover every pair of the factors' values (not
their whole product), two in the default suite and the rest in the slow stage.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from pdserve import LLM
from tests.unit.engine.test_correctness import (
    RUNNERS,
    assert_pool_full,
    make_prompts,
    reference,
    run,
)

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
FACTORS = (["mp", "ray"], list(LAYOUTS), RUNNERS, ["async", "sync"], ["llama", "qwen2_moe"])
# Every pair of two factors' values in at least one cell (all-pairs: 8 cells of the 48 the
# product has; a fault shows in the interaction of two factors far more often than of three).
# The first two stay in the default suite.
CELLS = [
    ("mp", "tp2", "v2", "async", "llama"),
    ("mp", "tp2", "v1", "sync", "qwen2_moe"),
    ("ray", "pp2", "v1", "async", "llama"),
    ("ray", "tp2pp2", "v2", "sync", "qwen2_moe"),
    ("mp", "pp2", "v2", "async", "qwen2_moe"),
    ("mp", "tp2pp2", "v1", "async", "llama"),
    ("mp", "pp2", "v1", "sync", "llama"),
    ("ray", "tp2", "v1", "async", "llama"),
]
FAST = CELLS[:2]


def _pairs(cell: tuple[str, ...]) -> set[tuple[int, str, int, str]]:
    return {(i, cell[i], j, cell[j]) for i, j in itertools.combinations(range(len(cell)), 2)}


def test_the_cells_cover_every_pair_of_factors() -> None:
    every = set().union(*(_pairs(c) for c in itertools.product(*FACTORS)))
    assert set().union(*(_pairs(c) for c in CELLS)) == every


def cells() -> list:
    return [
        pytest.param(*cell, marks=[] if cell in FAST else [pytest.mark.slow], id="-".join(cell))
        for cell in CELLS
    ]


@pytest.fixture(scope="module")
def ray_started():
    """One local Ray for the module's ray cells, started only if one of them runs."""
    started = []

    def start() -> None:
        if started:
            return
        ray = pytest.importorskip("ray", reason="the ray extra is not installed")
        import os

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if not ray.is_initialized():
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
            started.append(ray)

    yield start
    for ray in started:
        ray.shutdown()


@pytest.mark.parametrize("backend,layout,runner,mode,arch", cells())
def test_layout_matches_hf(
    tiny_model: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
    ray_started,
    backend: str,
    layout: str,
    runner: str,
    mode: str,
    arch: str,
) -> None:
    if backend == "ray":
        ray_started()
    monkeypatch.setenv("PDSERVE_USE_V2_MODEL_RUNNER", RUNNERS[runner])
    tp, pp = LAYOUTS[layout]
    path = tiny_model(arch)
    with LLM(
        model=path,
        dtype="float32",
        max_model_len=256,
        # Chunks: steps in which no request samples still pass activations between stages.
        max_num_batched_tokens=32,
        max_num_seqs=8,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
        async_scheduling=mode == "async",
    ) as llm:
        assert llm.config.scheduler_config.async_scheduling is (mode == "async")
        # A shared prefix: later prompts start from cached blocks on every layout.
        prompts = make_prompts(llm.config.model_config.vocab_size, shared_prefix=20)[::2]
        assert run(llm, prompts) == reference(path, prompts)
        assert_pool_full(llm)
