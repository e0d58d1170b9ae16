"""A real `pdserve serve` (or proxy) process for tests: started, awaited, stopped, no orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from pdserve.utils import get_open_port
from tests.utils.procs import pid_alive, wait_until_gone

_REPO = Path(__file__).resolve().parents[2]
_BIND_ATTEMPTS = 3
# pdserve's log lines ("WARNING pdserve.x: ..."), uvicorn's ("ERROR:    ..."), tracebacks and
# Python's warnings ("...: UserWarning: ...").
_COMPLAINT = re.compile(r"^(WARNING|ERROR|CRITICAL)\b|^Traceback|Warning: ")


def sigkill(server: RemoteServer) -> None:
    """SIGKILL a server and every process below it, as a crash would."""
    for pid in [server.proc.pid, *descendants(server.proc.pid)]:
        os.kill(pid, signal.SIGKILL)
    server.proc.wait()


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc, Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


class MetricsReader:
    """Reads an instance's /metrics: any server, also one this test did not start."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.headers = headers or {}

    def metric(self, name: str, **labels: str) -> float:
        """The value of the first `pdserve:<name>` sample with these labels (0 if none yet)."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        for line in text.splitlines():
            if (
                line.startswith(f"pdserve:{name}{{") or line.startswith(f"pdserve:{name} ")
            ) and all(w in line for w in wanted):
                return float(line.rsplit(" ", 1)[1])
        if labels:
            return 0.0
        raise KeyError(name)

    def wait_pool_full(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            free, total = self.metric("kv_cache_free_blocks"), self.metric("kv_cache_total_blocks")
            if free == total - 1 and self.metric("num_requests_running") == 0:
                return
            time.sleep(0.1)
        raise AssertionError(f"block pool not full after {timeout} s: {free} free of {total - 1}")


class RemoteServer(MetricsReader):
    """`RemoteServer(["serve", "--model", m, ...])` runs `pdserve <args> --port <free port>`."""

    def __init__(
        self,
        args: list[str],
        startup_timeout: float = 240.0,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        prefix: list[str] | None = None,
        command: list[str] | None = None,
        port: int | None = None,
    ) -> None:
        """`prefix` runs the command under another (e.g. `ip netns exec NS`); `host` is where
        the server listens and is reached; `command` is the program given `args` (default:
        this interpreter's `-m pdserve.entrypoints.cli`), e.g. another venv's `pdserve`; `port`: that
        one (a restarted instance), not a free one."""
        args = [*args, "--api-key", api_key] if api_key else args
        if host != "127.0.0.1":
            args = [*args, "--host", host]
        command = [*(prefix or []), *(command or [sys.executable, "-m", "pdserve.entrypoints.cli"])]
        # The port is free when chosen, but the server binds it only after loading its model:
        # seconds in which another process (an outgoing connection, a transport's listener) can
        # take it. A server that lost its port that way is started again on another.
        for attempt in range(_BIND_ATTEMPTS):
            self.port = port if port is not None and attempt == 0 else get_open_port()
            super().__init__(
                f"http://{host}:{self.port}",
                {"Authorization": f"Bearer {api_key}"} if api_key else None,
            )
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-test-{self.port}.log"
            self.log = open(self.log_path, "wb")
            self.proc = subprocess.Popen(
                [*command, *args, "--port", str(self.port)],
                cwd=_REPO,
                stdout=self.log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
            self.all_pids: list[int] = [self.proc.pid]
            try:
                self._wait_healthy(startup_timeout)
                return
            except RuntimeError:
                lost_port = "address already in use" in self.read_log()
                self.stop()
                if not lost_port or attempt == _BIND_ATTEMPTS - 1:
                    raise
            except BaseException:
                self.stop()
                raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.all_pids = [self.proc.pid, *descendants(self.proc.pid)]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy in {timeout:.0f} s:\n{self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def complaints_since(self, offset: int) -> list[str]:
        """What the server (and every process below it) logged after `offset` (a log_size())
        at WARNING or above, tracebacks and Python warnings included."""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
        return [line for line in lines if _COMPLAINT.search(line)]

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=kwargs.pop("api_key", "none"),
            max_retries=0,
            **kwargs,
        )

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key=kwargs.pop("api_key", "none"),
            max_retries=0,
            **kwargs,
        )

    def stop(self, timeout: float = 30.0) -> list[int]:
        """SIGTERM, then SIGKILL; returns the processes (this one and below) still alive."""
        pids = [p for p in dict.fromkeys(self.all_pids + descendants(self.proc.pid))]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = wait_until_gone(pids, timeout)
        for pid in left:  # never leave them behind, even when the test fails on it
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()
        return left

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_together(*starts: Callable[[], RemoteServer]) -> list[RemoteServer]:
    """The servers `starts` make, started side by side: a start is mostly its processes' imports
    and model load, so two take about the time of one on two cores, where one after the other
    took twice. If any start fails, those that came up are stopped and its error raised."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    servers = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for server in servers:
            server.stop()
        raise failed[0]
    return servers
