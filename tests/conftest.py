"""Shared fixtures: tiny random models built once per session, never downloaded.

Without a GPU, Triton kernels run in Triton's interpreter. Triton reads TRITON_INTERPRET when a
function is decorated (its own library functions included, at `import triton`), so it is set
here, before any test module imports pdserve. The torch references ignore it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The servers and workers the tests start share this machine's cores with each other and with
# this process: their OpenMP threads sleep at a barrier rather than spin (a spin takes the core
# a preempted sibling needs; see envs.apply_openmp_defaults). This process's own runtime
# started with torch above.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.utils.tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """tiny_model("llama") -> path of a tiny random HF model folder of that architecture."""
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = make_tiny_model(arch, root / arch)
        return str(built[arch])

    return get
