"""`pip install <checkout>` into a bare venv, and nothing else (no Makefile, no extra package),
gives a split deployment that works with the default transport: a prefill instance of that
venv's `pdserve serve` hands a request's KV to a decode instance, which continues it with HF's
tokens. The tiny model is built by this test's own interpreter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.utils import get_open_port
from tests.utils.pd import split_request
from tests.utils.server import RemoteServer
from tests.utils.tiny_models import hf_greedy, make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
PROMPT = [(i * 37) % 400 + 5 for i in range(40)]  # two full blocks and a partial one
MAX_TOKENS = 12
# Nothing of the checkout or of this interpreter's packages reaches the installed servers.
CLEAN_ENV = {"PYTHONPATH": "", "VIRTUAL_ENV": "", "PYTHONNOUSERSITE": "1"}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("pip_install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", str(REPO)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, **CLEAN_ENV},
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    yield venv
    shutil.rmtree(venv)  # 2.4 GB, torch and the transports' CUDA libraries mostly


@pytest.fixture
def servers() -> Iterator[list[RemoteServer]]:
    started: list[RemoteServer] = []
    yield started
    left = [pid for server in started for pid in server.stop()]
    assert left == [], f"processes left behind: {left}"


def start(venv: Path, model: Path, role: str, servers: list[RemoteServer]) -> RemoteServer:
    """One instance of the installed `pdserve serve`; its kv_transfer_config names no
    transport, so the default one serves."""
    config = {"kv_connector": "NixlConnector", "kv_role": role}
    server = RemoteServer(
        ["serve", "--model", str(model), "--dtype", "float32"]
        + ["--kv-transfer-config", json.dumps(config)],
        env={**CLEAN_ENV, "PDSERVE_SIDE_CHANNEL_PORT": str(get_open_port())},
        command=[str(venv / "bin" / "pdserve")],
    )
    servers.append(server)
    return server


def test_pip_install_alone_hands_a_request_over(
    venv: Path, servers: list[RemoteServer], tmp_path: Path
) -> None:
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util, pdserve; "
            "print(pdserve.__file__, importlib.util.find_spec('nixl') is None)",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={**os.environ, **CLEAN_ENV},
    )
    package, no_meta_package = probe.stdout.split()
    assert Path(package).is_relative_to(venv), package
    # What a plain install gives: the NIXL wheel without the `nixl` meta package.
    assert no_meta_package == "True"

    model = make_tiny_model("llama", tmp_path / "llama")
    expected = hf_greedy(model, [PROMPT], MAX_TOKENS)[0]
    p = start(venv, model, "kv_producer", servers)
    d = start(venv, model, "kv_consumer", servers)
    body = {
        "model": str(model),
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    resp = split_request(p, d, body)
    assert resp.status_code == 200, resp.text + d.read_log()
    assert resp.json()["choices"][0]["token_ids"] == expected
    assert d.metric("kv_transfers_total") == 1
    assert d.metric("kv_transfer_bytes_total") > 0
    for server in servers:
        server.wait_pool_full(timeout=30)
