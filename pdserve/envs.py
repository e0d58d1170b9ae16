"""Every PDSERVE_* environment variable, read in one place.

Values are read on access (not at import) so tests can set them with monkeypatch.
"""

from __future__ import annotations

import os
from pathlib import Path


def apply_openmp_defaults() -> None:
    """GOMP_SPINCOUNT=20000 unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is given: an OpenMP thread
    that reaches a barrier spins that long (well under a millisecond), then sleeps. A decode step
    opens a parallel region per matmul (about 120 for SmolLM2), and a thread woken from sleep
    takes 50-300 us on these VMs: on a quiet 2-core machine SmolLM2 (benchmarks/vs_vllm.py's
    workload) generated in 7.1-7.2 s with this spin, 9.3 s passive, 6.8 s spinning without bound.
    Beside another busy process the bound keeps the cost of spinning on a core a preempted sibling
    needs at 1.6x passive (4.5 s against 2.9 s for 32 tokens; unbounded: 2.0x). Where engines
    share cores, set OMP_WAIT_POLICY=PASSIVE (the test suite does). Read once, when torch loads
    libgomp, so `import pdserve` applies it only if torch is not imported yet; workers inherit it."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "20000"


def _tri_state(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be unset, '0' or '1', got {value!r}.")
    return value == "1"


def use_v2_model_runner() -> bool | None:
    """PDSERVE_USE_V2_MODEL_RUNNER: unset = decide by model, '0' = runner V1, '1' = runner V2."""
    return _tri_state("PDSERVE_USE_V2_MODEL_RUNNER")


def batch_invariant() -> bool:
    """PDSERVE_BATCH_INVARIANT: '1' makes the Triton paths batch invariant, as vLLM's
    VLLM_BATCH_INVARIANT does (matmuls in a fixed tile order, attention split at a fixed size);
    '0' or unset (the default) lets cuBLAS and the split heuristic choose by batch. The CPU
    kernels are batch invariant either way."""
    return _tri_state("PDSERVE_BATCH_INVARIANT") is True


def kernel_backend() -> str | None:
    """PDSERVE_KERNEL_BACKEND: 'triton' or 'torch' forces a kernel backend; unset = by device."""
    value = os.environ.get("PDSERVE_KERNEL_BACKEND") or None
    if value not in (None, "triton", "torch"):
        raise ValueError(f"PDSERVE_KERNEL_BACKEND must be 'triton' or 'torch', got {value!r}.")
    return value


def cpu_kv_cache_space_gib() -> float:
    """PDSERVE_CPU_KVCACHE_SPACE: GiB of memory for the KV cache on CPU (default 1)."""
    value = os.environ.get("PDSERVE_CPU_KVCACHE_SPACE", "1")
    try:
        space = float(value)
    except ValueError:
        raise ValueError(
            f"PDSERVE_CPU_KVCACHE_SPACE must be a number of GiB, got {value!r}."
        ) from None
    if space <= 0:
        raise ValueError(f"PDSERVE_CPU_KVCACHE_SPACE must be positive, got {value!r}.")
    return space


def default_model() -> str | None:
    """PDSERVE_DEFAULT_MODEL: model served when none is named (default: bundled SmolLM2)."""
    return os.environ.get("PDSERVE_DEFAULT_MODEL") or None


def api_key() -> str | None:
    """PDSERVE_API_KEY: bearer token the server requires on every endpoint but /health."""
    return os.environ.get("PDSERVE_API_KEY") or None


def log_level() -> str:
    """PDSERVE_LOG_LEVEL: log level of engine and worker processes (the CLI's --log-level sets it)."""
    return os.environ.get("PDSERVE_LOG_LEVEL", "WARNING").upper()


def side_channel_host() -> str:
    """PDSERVE_SIDE_CHANNEL_HOST: address a prefill instance's handshake socket binds and
    advertises (default 127.0.0.1; a host's own address for multi-host deployments)."""
    return os.environ.get("PDSERVE_SIDE_CHANNEL_HOST") or "127.0.0.1"


def side_channel_port() -> int:
    """PDSERVE_SIDE_CHANNEL_PORT: its TCP port (default 5600, vLLM's)."""
    value = os.environ.get("PDSERVE_SIDE_CHANNEL_PORT") or "5600"
    try:
        port = int(value)
    except ValueError:
        raise ValueError(
            f"PDSERVE_SIDE_CHANNEL_PORT must be a port number, got {value!r}."
        ) from None
    if not 0 < port < 65536:
        raise ValueError(f"PDSERVE_SIDE_CHANNEL_PORT must be in 1..65535, got {port}.")
    return port


def kv_fault_plan() -> Path | None:
    """PDSERVE_KV_FAULT_PLAN: tests only. A JSON fault plan; when set, every KV transport of the
    process is wrapped in the fault-injecting transport (kv_connector/transport/fault.py)."""
    value = os.environ.get("PDSERVE_KV_FAULT_PLAN") or None
    return Path(value) if value else None


def cpu_threads() -> int | None:
    """PDSERVE_CPU_THREADS: torch threads of each CPU worker (default: cores / workers of this
    instance). `pdserve launch` sets it so that instances sharing a host do not oversubscribe."""
    value = os.environ.get("PDSERVE_CPU_THREADS") or None
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"PDSERVE_CPU_THREADS must be a positive integer, got {value!r}.")
    return int(value)


def core_board() -> tuple[Path, int] | None:
    """PDSERVE_CORE_BOARD: 'PATH:SLOT', set by `pdserve launch` for the instances it starts on one
    host: the board of executor/cpu_cores.py on which their CPU workers lend each other idle
    cores, and the first slot of this instance (its ranks take SLOT, SLOT + 1, ...)."""
    value = os.environ.get("PDSERVE_CORE_BOARD") or None
    if value is None:
        return None
    path, _, slot = value.rpartition(":")
    if not path or not slot.isdigit():
        raise ValueError(f"PDSERVE_CORE_BOARD must be 'PATH:SLOT', got {value!r}.")
    return Path(path), int(slot)


def cache_dir() -> Path:
    """PDSERVE_CACHE_DIR: where built CPU kernels and compiled graphs are kept across runs
    (default ~/.cache/pdserve)."""
    value = os.environ.get("PDSERVE_CACHE_DIR") or None
    return Path(value) if value else Path.home() / ".cache" / "pdserve"


def cxx_compiler() -> str:
    """CXX: the C++ compiler that builds the CPU kernels (default g++)."""
    return os.environ.get("CXX") or "g++"
