"""The package's shape limits hold (tools/code_shape.py, issue 28): no file over 400 lines, no
function over 100 lines outside kernels/ (60 in the proxy and the API server), and no
package-level import cycle."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "tools" / "code_shape.py"
_SPEC = importlib.util.spec_from_file_location("code_shape", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
code_shape = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(code_shape)


def test_no_file_over_the_limit() -> None:
    assert code_shape.long_files() == []


def test_no_function_over_the_limit() -> None:
    assert code_shape.long_functions() == []


def test_no_package_level_import_cycle() -> None:
    cycles = code_shape.import_cycles()
    assert cycles == [], [code_shape.import_examples(c) for c in cycles]
