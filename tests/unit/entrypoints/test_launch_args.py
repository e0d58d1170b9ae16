"""`pdserve launch`'s refusals, before it starts anything."""

from __future__ import annotations

import importlib.util

import pytest

from pdserve.entrypoints.cli import main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill", "0"], "--prefill and --decode must each be at least 1"),
        (["--decode", "0"], "--prefill and --decode must each be at least 1"),
        (["--ray", "--ray-cpus-per-rank", "0"], "--ray-cpus-per-rank must be at least 1"),
    ],
)
def test_bad_counts_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is installed")
def test_ray_without_ray_installed_says_what_to_install(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--ray"]) == 1
    err = capsys.readouterr().err
    assert "No module named 'ray'" in err and "pip install 'pdserve[ray]'" in err
