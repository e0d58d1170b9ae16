"""Shared fixtures: tiny random models built once per session, never downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from tests.utils.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """tiny_model("llama") -> path of a tiny random HF model folder of that architecture."""
    root = tmp_path_factory.mktemp("tiny_models")
    built: dict[str, Path] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = make_tiny_model(arch, root / arch)
        return str(built[arch])

    return get
