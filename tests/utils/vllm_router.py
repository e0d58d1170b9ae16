"""vLLM's Rust router (`vllm-router`, PyPI) in its own virtual environment, started in front of
pdserve instances the way users run it: for tests of the slow stage and for benchmarks."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from pdserve.utils import get_open_port
from tests.utils.venvs import console_script

VERSION = "0.1.17"
_REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("PDSERVE_ROUTER_VENV", _REPO / ".venv-router"))


def router_binary() -> Path:
    """The `vllm-router` console script, installed on first use (pinned, its own venv)."""
    return console_script(VENV, f"vllm-router=={VERSION}", "vllm-router")


class Router:
    """`vllm-router --vllm-pd-disaggregation` over instances; stopped on exit, no orphans."""

    def __init__(self, prefill: list[str], decode: list[str], *flags: str, log: Path) -> None:
        self.port = get_open_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            str(router_binary()),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            # Its default metrics port collides when two run.
            "--prometheus-port", str(get_open_port()),
            "--vllm-pd-disaggregation",
        ]  # fmt: skip
        for url in prefill:
            args += ["--prefill", url]
        for url in decode:
            args += ["--decode", url]
        self.log_path = log
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([*args, *flags], stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"vllm-router not ready: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
