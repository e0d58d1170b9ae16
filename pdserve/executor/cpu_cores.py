"""A CPU worker's torch threads, and the cores lent between instances that share a host.

`pdserve launch` starts a prefill and a decode instance on one host and gives each worker its
share of the cores, so that they do not oversubscribe them when both are busy. But a lone
request then prefills on half the machine while the decode instance sits idle (SmolLM2 bf16, 380
tokens on 2 cores: 250 ms through the split against 166 ms on one instance). So the launcher also
hands its instances a core board: a shared file of one byte per worker, 1 while that worker's
instance has requests. Each engine marks its instance's bytes when it gets work and when it runs
out of it; before a step that prefills, a worker runs on its share plus its part of the shares of the
idle workers. An instance that gets work while its cores are lent does not wait: both run on
them until the borrower's step ends, one step of oversubscription at most.

A step borrows only for enough prefill work to pay for a second thread: one that has slept
while its instance was idle takes up to 20 ms to be running beside the first again here
(a tiny model's 380-token prefill: 4 ms warm, 11-25 ms on a second thread just woken), so
the prefill must be worth tens of ms on one thread (_MIN_BORROWED_FLOPS: SmolLM2's 47 tokens).
Decode-only steps run on their share. A decode instance that borrowed the prefill instance's
idle core held it through each step in which a request arrived there: under load (SmolLM2,
48 chat requests at 4/s, benchmarks/pd_serving.py) its inter-token latency p99 went from 96 to
113 ms, while a prefill step borrows only when the decode instance has no requests at all.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pdserve import envs
from pdserve.core_board import CoreBoard, NoCoreBoard, instance_board

if TYPE_CHECKING:
    import torch

    from pdserve.scheduler.output import SchedulerOutput


def _set_threads(threads: int) -> None:
    import torch  # here, so that the launcher makes a board without loading torch

    torch.set_num_threads(threads)


# About 30 ms of one AMX thread's prefill here (SmolLM2: 80 GFLOP in 250 ms).
_MIN_BORROWED_FLOPS = 1e10


class FixedThreads:
    """Threads set once and never lent: a CPU worker's share, or a GPU worker's torch default."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads
        if threads is not None:
            _set_threads(threads)

    def model_loaded(self, model: torch.nn.Module) -> None:
        return None

    def before_step(self, scheduler_output: SchedulerOutput) -> None:
        return None


class BorrowedThreads(FixedThreads):
    """Its share, plus its part (one of `world_size` workers) of the idle workers' shares."""

    def __init__(self, threads: int, board: CoreBoard, world_size: int) -> None:
        super().__init__(threads)
        self.share = threads
        self.board = board
        self.world_size = world_size
        self.cores = os.cpu_count() or threads
        self.flops_per_token = 0

    def model_loaded(self, model: torch.nn.Module) -> None:
        """A token's forward costs about two FLOPs per weight of the decoder layers (the
        embedding is a lookup, the LM head runs for the sampled rows only)."""
        weights = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
        self.flops_per_token = 2 * weights

    def before_step(self, scheduler_output: SchedulerOutput) -> None:
        threads = self.share
        # A decode step has one token per request: the rest are prompt tokens.
        so = scheduler_output
        prefill_tokens = so.total_num_scheduled_tokens - len(so.num_scheduled_tokens)
        if prefill_tokens * self.flops_per_token > _MIN_BORROWED_FLOPS:
            lent = self.share * self.board.idle_elsewhere() // self.world_size
            threads = min(self.cores, self.share + lent)
        if threads != self.threads:
            _set_threads(threads)
            self.threads = threads


def cpu_threads(world_size: int) -> FixedThreads:
    """The threads of a CPU worker: PDSERVE_CPU_THREADS (default: this instance's ranks split the
    host's cores), with the idle instances' on PDSERVE_CORE_BOARD when the launcher set one."""
    threads = envs.cpu_threads() or max(1, (os.cpu_count() or 1) // world_size)
    board = instance_board(world_size)
    if isinstance(board, NoCoreBoard):
        return FixedThreads(threads)
    return BorrowedThreads(threads, board, world_size)
