"""What the scheduler reports with every batch of outputs (feeds /metrics)."""

from __future__ import annotations

import msgspec


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    # Free blocks == num_blocks - 1 (the null block) means nothing is held: tests assert it.
    num_free_blocks: int
    num_blocks: int
