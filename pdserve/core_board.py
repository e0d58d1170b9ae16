"""The core board: a file shared by the instances `pdserve launch` starts on one host, one byte per
worker, 1 while that worker's instance has requests. Each engine marks its own bytes; a CPU worker
reads the others' to borrow idle cores for a prefill (executor/cpu_cores.py says when)."""

from __future__ import annotations

import mmap
from pathlib import Path

from pdserve import envs


class CoreBoard:
    """One instance's view of the board: its workers' bytes, `first` to `first + count`."""

    def __init__(self, path: Path, first: int, count: int) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.bytes = memoryview(self._map)
        if first + count > len(self.bytes):
            raise ValueError(
                f"PDSERVE_CORE_BOARD: workers {first}..{first + count - 1} are not on the board "
                f"of {path} ({len(self.bytes)} workers)."
            )
        self.mine = range(first, first + count)
        self.busy = False

    def mark(self, busy: bool) -> None:
        """The engine: whether its instance has requests now."""
        if busy != self.busy:
            for i in self.mine:
                self.bytes[i] = busy
            self.busy = busy

    def idle_elsewhere(self) -> int:
        """Workers of other instances that have no requests."""
        return sum(1 for i, busy in enumerate(self.bytes) if not busy and i not in self.mine)


class NoCoreBoard:
    """An instance alone on its cores (not started by `pdserve launch`, or a GPU one)."""

    def mark(self, busy: bool) -> None:
        return None


def instance_board(world_size: int) -> CoreBoard | NoCoreBoard:
    """This instance's part of PDSERVE_CORE_BOARD, if the launcher set one."""
    board = envs.core_board()
    return NoCoreBoard() if board is None else CoreBoard(board[0], board[1], world_size)


def create_board(path: Path, workers: int) -> None:
    """A board for `workers` workers, every one idle."""
    path.write_bytes(bytes(workers))
