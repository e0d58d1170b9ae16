"""A KV transport in a child process, driven over a Pipe: the far side of the transport tests.

The child registers one region of `num_blocks` blocks filled by `kv_pattern`, so the parent
can check every byte it reads without the child shipping the expected data.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from tests.utils.procs import wait_until_gone


def kv_pattern(num_blocks: int, block_len: int, seed: int) -> torch.Tensor:
    """uint8 [num_blocks * block_len]: every 8-byte word differs, across blocks and seeds."""
    words = torch.arange(num_blocks * block_len // 8, dtype=torch.int64) + (seed << 40)
    # An odd multiplier permutes 64-bit words (wrapping), spreading them over every byte.
    return (words * 0x1E3779B97F4A7C15).view(torch.uint8)


def _serve(
    conn: Connection,
    backend: str,
    name: str,
    num_blocks: int,
    block_len: int,
    seed: int,
    timeout_s: float,
) -> None:
    from pdserve.kv_connector.transport import Desc, XferState, make_transport

    logging.basicConfig(level=logging.WARNING)
    transport = make_transport(backend, name, timeout_s=timeout_s)
    region = kv_pattern(num_blocks, block_len, seed)
    transport.register_region(region)
    conn.send((transport.get_agent_metadata(), os.getpid()))
    notifs: list[tuple[str, bytes]] = []
    while True:
        cmd, *args = conn.recv()
        if cmd == "add":
            conn.send(transport.add_remote_agent(args[0]))
        elif cmd == "blocks":  # (block ids): their bytes now, as a WRITE left them
            conn.send(region.view(num_blocks, block_len)[list(args[0])].clone())
        elif cmd == "notify":
            transport.send_notif(args[0], args[1])
            conn.send(None)
        elif cmd == "read_forever":  # (agent, nbytes): READ the agent's region 0 until killed
            conn.send(None)
            desc = [Desc(0, 0, args[1])]
            while True:
                handle = transport.read(args[0], desc, desc, b"loop")
                while transport.check_state(handle) is XferState.PENDING:
                    time.sleep(0.0005)
                transport.release(handle)
        elif cmd == "notifs":  # (count, timeout): wait for `count` more, return all drained
            count, deadline = args[0], time.monotonic() + args[1]
            while True:
                notifs += transport.get_new_notifs()
                if len(notifs) >= count or time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            conn.send(notifs)
            notifs = []
        else:
            assert cmd == "stop", cmd
            transport.shutdown()
            conn.send(None)
            return


def _stopped(pid: int, tid: str) -> bool:
    """Whether thread `tid` of `pid` is stopped (state T in /proc), or gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in "Tt"
    except FileNotFoundError:
        return True


class PeerProcess:
    """One child transport; `close()` stops it (politely, then by SIGKILL) and reaps it."""

    def __init__(
        self,
        backend: str,
        name: str,
        num_blocks: int,
        block_len: int,
        seed: int = 1,
        timeout_s: float = 3.0,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve,
            args=(child_conn, backend, name, num_blocks, block_len, seed, timeout_s),
            daemon=True,
        )
        self.proc.start()
        child_conn.close()
        self.metadata, self.pid = self._recv(60.0)

    def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self.conn.send(cmd)
        return self._recv(timeout)

    def freeze(self) -> None:
        """SIGSTOP: alive, but its transport makes no progress until it is killed.

        Returns once every thread is stopped: the signal is delivered asynchronously, and a
        progress thread still running serves a READ posted just after the kill() call.
        """
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while not all(_stopped(self.pid, tid) for tid in os.listdir(f"/proc/{self.pid}/task")):
            assert time.monotonic() < deadline, f"peer {self.pid} did not stop"
            time.sleep(0.001)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)
        assert not wait_until_gone([self.pid], 5.0), "killed peer still alive"

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=10.0)
            except (EOFError, OSError, TimeoutError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        assert not wait_until_gone([self.proc.pid], 5.0), "peer process left behind"

    def _recv(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.proc.pid} did not answer within {timeout} s")
        return self.conn.recv()
