"""Process checks for tests that must leave no process behind (reads /proc; Linux)."""

from __future__ import annotations

import time


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_until_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait for every pid to exit; returns the ones still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive
