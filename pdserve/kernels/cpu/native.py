"""CPU kernels in C++, built once per machine with its own compiler and loaded with ctypes.

No torch headers and no pybind: a kernel file builds in about a second, so it is built at first
use (after torch is imported, so that its OpenMP runtime is the one the kernel finds) and kept in
the cache directory, keyed by its source, the flags and the CPU (it is built for
this CPU's instruction set). Where no compiler works, the torch reference runs instead and the
reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdserve import envs

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# Fast math vectorizes the reductions and the softmax's exp (glibc's libmvec, which finite-math
# is the condition of); the kernels never rely on infinities.
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_LIBS = ("-lmvec",)


def _cpu_id() -> str:
    """The CPU's feature flags: a library built with -march=native runs only where they match."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def compiler_available() -> bool:
    """Whether the configured compiler exists: without one the torch references run, and the
    kernels' tests skip; a kernel that fails to build with one is an error to see."""
    return shutil.which(envs.cxx_compiler()) is not None


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (avx512_bf16, amx_bf16, ...) for this CPU."""
    return flag in _cpu_id().split()


def _build(name: str) -> Path:
    source = _CSRC / f"{name}.cpp"
    compiler = envs.cxx_compiler()
    key = hashlib.sha256(
        b"\0".join(
            [
                source.read_bytes(),
                # The shared headers too: a change there must rebuild every kernel.
                *(header.read_bytes() for header in sorted(_CSRC.glob("*.h"))),
                compiler.encode(),
                " ".join(_FLAGS + _LIBS).encode(),
                _cpu_id().encode(),
            ]
        )
    ).hexdigest()[:16]
    target = envs.cache_dir() / "kernels" / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: processes that build at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, str(source), *_LIBS, "-o", tmp],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The built library of csrc/<name>.cpp, or None (logged once) where it cannot be built."""
    try:
        return ctypes.CDLL(str(_build(name)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
        logger.warning("CPU kernel %s unavailable, using the torch reference: %s", name, detail)
        return None


def pointer(t: torch.Tensor | None) -> int | None:
    """A kernel argument: the tensor's data, or NULL for an absent one (a bias)."""
    return t.data_ptr() if t is not None else None


@functools.cache
def function(
    name: str, symbol: str, *argtypes: type, restype: type | None = None
) -> ctypes._CFuncPtr | None:
    """`symbol` of csrc/<name>.cpp with its argument types, or None where it cannot be built."""
    lib = load(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn
