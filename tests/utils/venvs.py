"""Tools that run beside pdserve from their own virtual environments (their dependencies
would clash with pdserve's), installed on first use, pinned."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def console_script(venv: Path, requirement: str, script: str) -> Path:
    """`script` of `venv`, creating the venv and installing `requirement` there if needed."""
    binary = venv / "bin" / script
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", requirement], check=True)
    return binary
