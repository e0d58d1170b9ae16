"""pdserve: an LLM inference engine with disaggregated prefill/decode."""

from typing import Any

from pdserve import envs

envs.apply_openmp_defaults()  # before anything imports torch

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pdserve.engine.llm",
    "SamplingParams": "pdserve.sampling_params",
    "RequestOutput": "pdserve.outputs",
    "EngineConfig": "pdserve.config",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that `import pdserve` in a worker or a CLI stays light.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
