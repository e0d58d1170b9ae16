"""Process-wide defaults pdserve sets before torch loads its OpenMP runtime."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = (
    "import os, pdserve, torch; "
    "torch.set_num_threads(2); torch.ones(1 << 16).sum(); "  # libgomp starts with the env
    "print(os.environ['OMP_WAIT_POLICY'])"
)


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_import_sets_a_passive_openmp_wait_unless_given(given: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected
