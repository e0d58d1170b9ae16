"""The tiny model whose config the lifecycle tests' EngineConfig reads (no weights are loaded)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def model(tiny_model: Callable[[str], str]) -> str:
    return tiny_model("llama")
