"""Process-wide defaults pdserve sets before torch loads its OpenMP runtime."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = (
    "import os, pdserve, torch; "
    "torch.set_num_threads(2); torch.ones(1 << 16).sum(); "  # libgomp starts with the env
    "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, "None 20000"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE None"),
        ({"GOMP_SPINCOUNT": "0"}, "None 0"),
    ],
)
def test_import_bounds_the_openmp_spin_unless_given(given: dict[str, str], expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**env, **given},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == expected
