"""Every Triton kernel compiles for sm_80 and sm_90, in every configuration the engine launches
(kernels/triton/launch_configs.py), with Triton's real compiler and no GPU (kernels/triton/aot.py). The
default suite compiles every kernel and variant for two model shapes in bf16 for sm_90 (--quick,
about a minute on a cold cache); the slow stage compiles all of them for both targets (about
28 CPU-minutes cold, the default suite's share taken from Triton's cache).

The suite runs kernels in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET, which
the kernel modules read when they load), and the interpreter accepts kernels the compiler
rejects: the compile runs in a fresh process without it. Binaries are cached by Triton under
PDSERVE_CACHE_DIR/triton, keyed by source: a cold cache takes about 28 CPU-minutes, a warm one
under two (docs/kernels.md).

An fp8 KV cache's variants compile for the targets whose Triton has their format: e5m2 for both,
e4m3 (fp8e4nv) for sm_90 only, and the engine refuses the others by name. The GGUF
dequantize-matmul compiles in each of its formats (Q4_0, Q4_1, Q8_0) for every target.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402

from pdserve.kernels.triton import launch_configs as lc  # noqa: E402

_ENV_DROPPED = ("TRITON_INTERPRET", "PDSERVE_KERNEL_BACKEND")
# Problems shown with the compiler's whole message; the rest by their first line.
_SHOWN = 5


def _summary(problems: list[str]) -> str:
    rest = [p.splitlines()[0] for p in problems[_SHOWN:]]
    tail = f"\n\n{len(rest)} more:\n" + "\n".join(rest) if rest else ""
    return f"{len(problems)} problems:\n\n" + "\n\n".join(problems[:_SHOWN]) + tail


def _compile(tmp_path: Path, archs: tuple[int, ...], *flags: str) -> dict:
    report = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k not in _ENV_DROPPED}
    cmd = [sys.executable, "-m", "pdserve.kernels.triton.aot", "--jobs", "2", "--json", str(report)]
    cmd += ["--arch", *map(str, archs), *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    assert report.exists(), f"no report (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
    result = json.loads(report.read_text())
    assert not result["problems"], _summary(result["problems"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {b["arch"] for b in result["binaries"]} == set(archs)
    return result


def _gguf_formats(result: dict) -> set[tuple[int, int]]:
    """(arch, bytes a block) of the GGUF dequantize-matmul's binaries: 18, 20, 34 for Q4_0,
    Q4_1, Q8_0."""
    return {
        (b["arch"], int(re.search(r"'BLOCK_BYTES': (\d+)", b["constexprs"]).group(1)))
        for b in result["binaries"]
        if b["kernel"] == "pdserve.kernels.triton.quant_matmul._quant_matmul_kernel"
    }


def test_every_kernel_and_variant_compiles_for_gpu_targets(tmp_path: Path) -> None:
    result = _compile(tmp_path, (90,), "--quick")
    assert _gguf_formats(result) == {(90, 18), (90, 20), (90, 34)}


def test_fp8_cache_variants_compile_for_their_targets(tmp_path: Path) -> None:
    """The default model's fp8 variants (the default suite's share): sm_80's e5m2 is emulated."""
    result = _compile(tmp_path, (80, 90), "--quick", "--fp8-cache")
    formats = {
        (b["arch"], fp8)
        for b in result["binaries"]
        for fp8 in ("float8_e4m3fn", "float8_e5m2")
        if f"cache_dtype=torch.{fp8}" in b["launch"]
    }
    assert formats == {(80, "float8_e5m2"), (90, "float8_e4m3fn"), (90, "float8_e5m2")}


@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90, 100, 120])
def test_fp8_cache_refused_where_triton_lacks_the_format(arch: int) -> None:
    supported = CUDABackend(GPUTarget("cuda", arch, 32)).parse_options({}).supported_fp8_dtypes
    for fp8, name in ((torch.float8_e4m3fn, "fp8e4nv"), (torch.float8_e5m2, "fp8e5")):
        launch = lc.KVWriteLaunch(torch.bfloat16, 2, 64, 16, cache_dtype=fp8)
        assert lc.runs_on(launch, arch) == (name in supported)
        if name in supported:
            lc.check_fp8_cache_on_cuda(fp8, divmod(arch, 10))
        else:
            with pytest.raises(ValueError, match=r"float8_e4m3fn needs .* capability 8\.9"):
                lc.check_fp8_cache_on_cuda(fp8, divmod(arch, 10))


@pytest.mark.slow
# A cold cache took 17 minutes (27.5 CPU-minutes) on a 2-core machine at load 1-4 with the fp8
# cache's variants at every dtype (since at 16-bit ones only) and GGUF's: 12.5 CPU-minutes before.
@pytest.mark.timeout(3600)
def test_every_configuration_compiles_for_gpu_targets(tmp_path: Path) -> None:
    result = _compile(tmp_path, (80, 90))
    assert _gguf_formats(result) == {(arch, n) for arch in (80, 90) for n in (18, 20, 34)}
