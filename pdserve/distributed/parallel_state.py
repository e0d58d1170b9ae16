"""Tensor-parallel group state and its collectives.

Until `init_tensor_model_parallel` sets a group, the process is the only TP rank: rank 0 of
world size 1, and every collective is the identity. Layers read rank and size once, when they
are built, to size their shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None


def init_tensor_model_parallel(group: dist.ProcessGroup) -> None:
    """Make `group` this process's tensor-parallel group (torch.distributed must be initialized)."""
    global _TP_GROUP
    assert dist.is_initialized(), "torch.distributed must be initialized before the TP group"
    _TP_GROUP = group


def destroy_tensor_model_parallel() -> None:
    global _TP_GROUP
    _TP_GROUP = None


def get_tensor_model_parallel_rank() -> int:
    if _TP_GROUP is None or not dist.is_initialized():
        return 0
    return dist.get_rank(_TP_GROUP)


def get_tensor_model_parallel_world_size() -> int:
    if _TP_GROUP is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(_TP_GROUP)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks (in place; returns it)."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`, in rank order."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
