"""Small helpers with no better home."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

_EXIT_GRACE_S = 5.0

# What a child process sends up its ready pipe once started: (READY, payload) or (FAILED, why).
READY, FAILED = "READY", "FAILED"


# Ports handed out for servers that bind later: above Ray's worker ports (10002-19999 by
# default) and outside the OS's ephemeral range (read below).
_SERVER_PORTS = range(20000, 65536)
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_PORT_TRIES = 64
# Every port this process handed out: the launcher picks a dozen before any child binds one.
_handed_out: set[int] = set()
_handing_out = threading.Lock()  # servers started side by side ask from several threads


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (blocks for a count of tokens, shards for a count of rows)."""
    return -(a // -b)


def _server_ports() -> list[int]:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        return []
    return [p for p in _SERVER_PORTS if not low <= p <= high]


def get_open_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, outside the OS's ephemeral range where it can.

    A server binds its port only after loading its model: for seconds, any outgoing connection
    (Ray opens many) or listener bound to port 0 may take a port the OS picks from that range.
    A random port below it is taken only by another caller of this function picking it too,
    and never twice by this process.
    """
    with _handing_out:
        ports = [p for p in _server_ports() if p not in _handed_out]
        for port in random.SystemRandom().sample(ports, min(_PORT_TRIES, len(ports))):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _watch_parent(death_reader: Connection) -> None:
    """The parent holds the writing end: EOF means it is gone (or shutting us down).

    The main thread is interrupted with SIGTERM so that it leaves through its cleanup (closing
    and unlinking its queues); if it is stuck, the process exits anyway after a grace period.
    """
    try:
        death_reader.recv()
    except EOFError:
        pass
    # A real signal to the main thread, not _thread.interrupt_main: only a delivered signal
    # breaks the main thread out of a blocking call (an idle engine's poll) at once.
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # type: ignore[arg-type]
    time.sleep(_EXIT_GRACE_S)
    os._exit(1)


def exit_with_parent(death_reader: Connection) -> None:
    """For a child process: SIGTERM or the parent's death end it through SystemExit, so that
    finally-blocks run; Ctrl-C goes to the parent, which stops its children itself."""
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(death_reader,), daemon=True).start()


def wait_for_ready(proc: BaseProcess, reader: Connection, what: str, timeout_s: float) -> Any:
    """The payload `proc` sent with READY; a RuntimeError naming `what` if it failed, died or
    stayed silent for `timeout_s`."""
    try:
        if not reader.poll(timeout_s):
            raise RuntimeError(f"{what} did not start within {timeout_s:.0f} s.")
        status, payload = reader.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"{what} died during start-up (exit code {proc.exitcode}).") from None
    finally:
        reader.close()
    if status != READY:
        raise RuntimeError(f"{what} failed to start: {payload}")
    return payload
