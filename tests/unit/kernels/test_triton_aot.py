"""Every Triton kernel compiles for sm_80 and sm_90, in every configuration the engine launches
(kernels/triton/launch_configs.py), with Triton's real compiler and no GPU (kernels/triton/aot.py). The
default suite compiles every kernel and variant for two model shapes in bf16 for sm_90 (--quick,
about a minute on a cold cache); the slow stage compiles all of them for both targets (twelve
CPU-minutes cold, the default suite's share taken from Triton's cache).

The suite runs kernels in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET, which
the kernel modules read when they load), and the interpreter accepts kernels the compiler
rejects: the compile runs in a fresh process without it. Binaries are cached by Triton under
PDSERVE_CACHE_DIR/triton, keyed by source: a cold cache takes about 12 CPU-minutes, a warm one
under one (docs/kernels.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_ENV_DROPPED = ("TRITON_INTERPRET", "PDSERVE_KERNEL_BACKEND")
# Problems shown with the compiler's whole message; the rest by their first line.
_SHOWN = 5


def _summary(problems: list[str]) -> str:
    rest = [p.splitlines()[0] for p in problems[_SHOWN:]]
    tail = f"\n\n{len(rest)} more:\n" + "\n".join(rest) if rest else ""
    return f"{len(problems)} problems:\n\n" + "\n\n".join(problems[:_SHOWN]) + tail


def _compile(tmp_path: Path, archs: tuple[int, ...], *flags: str) -> None:
    report = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k not in _ENV_DROPPED}
    cmd = [sys.executable, "-m", "pdserve.kernels.triton.aot", "--jobs", "2", "--json", str(report)]
    cmd += ["--arch", *map(str, archs), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert report.exists(), f"no report (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
    result = json.loads(report.read_text())
    assert not result["problems"], _summary(result["problems"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {b["arch"] for b in result["binaries"]} == set(archs)


def test_every_kernel_and_variant_compiles_for_gpu_targets(tmp_path: Path) -> None:
    _compile(tmp_path, (90,), "--quick")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a cold cache took 17 minutes on a loaded 2-core machine
def test_every_configuration_compiles_for_gpu_targets(tmp_path: Path) -> None:
    _compile(tmp_path, (80, 90))
