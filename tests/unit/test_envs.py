"""pdserve/envs.py: the process-wide defaults pdserve sets before torch loads its OpenMP
runtime, and the switches' accepted values."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve import envs

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


@pytest.mark.parametrize(("value", "expected"), [("", False), ("0", False), ("1", True)])
def test_batch_invariant_switch(
    value: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", value)
    assert envs.batch_invariant() is expected
    monkeypatch.delenv("PDSERVE_BATCH_INVARIANT")
    assert envs.batch_invariant() is False


def test_batch_invariant_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", "true")
    with pytest.raises(ValueError, match="PDSERVE_BATCH_INVARIANT must be unset, '0' or '1'"):
        envs.batch_invariant()
