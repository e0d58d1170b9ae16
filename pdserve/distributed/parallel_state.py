"""Tensor- and pipeline-parallel state, and the communication each needs.

Until `init_tensor_model_parallel` / `init_pipeline_model_parallel` set them, the process is
the only rank of either: rank 0 of world size 1, the first and last pipeline stage, and every
collective is the identity. Layers and models read rank and size once, when they are built, to
size their shards and pick their layers.

Ranks are laid out stage-major: stage s holds the TP group [s * tp, (s + 1) * tp), and the TP
rank i of every stage forms one pipeline, {s * tp + i}. Activations go down a pipeline from
rank to rank; the sampled tokens come back from the output rank (the first TP rank of the last
stage) to every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
# The global ranks of this process's pipeline, in stage order, and this process's stage.
_PP_RANKS: tuple[int, ...] = (0,)
_PP_RANK = 0


def init_tensor_model_parallel(group: dist.ProcessGroup) -> None:
    """Make `group` this process's tensor-parallel group (torch.distributed must be initialized)."""
    global _TP_GROUP
    assert dist.is_initialized(), "torch.distributed must be initialized before the TP group"
    _TP_GROUP = group


def init_pipeline_model_parallel(ranks: Sequence[int], rank: int) -> None:
    """Make `ranks` (global ranks, one per stage, in stage order) the pipeline of the process of
    global rank `rank`. Models read the stage when they are built; sending activations needs
    torch.distributed as well."""
    global _PP_RANKS, _PP_RANK
    assert rank in ranks, f"rank {rank} is not in its pipeline {list(ranks)}"
    _PP_RANKS, _PP_RANK = tuple(ranks), list(ranks).index(rank)


def destroy_model_parallel() -> None:
    global _TP_GROUP, _PP_RANKS, _PP_RANK
    _TP_GROUP, _PP_RANKS, _PP_RANK = None, (0,), 0


# ---- tensor parallelism -------------------------------------------------------------------


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


# ---- pipeline parallelism -----------------------------------------------------------------


def get_pp_rank() -> int:
    """This process's pipeline stage."""
    return _PP_RANK


def get_pp_world_size() -> int:
    """The number of pipeline stages."""
    return len(_PP_RANKS)


def is_first_stage() -> bool:
    return _PP_RANK == 0


def is_last_stage() -> bool:
    return _PP_RANK == len(_PP_RANKS) - 1


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers [start, end) of stage `pp_rank`: contiguous, as even as possible.

    As vLLM splits them: the layers left over go one each to the stages before the last,
    counting back from the second-to-last; the last stage also computes the logits.
    """
    assert 1 <= pp_size <= num_layers, f"{num_layers} layers cannot make {pp_size} stages"
    partitions = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


@dataclass
class IntermediateTensors:
    """What a stage hands the next one: its activations by name (hidden_states, residual)."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def send_intermediate_tensors(intermediate: IntermediateTensors) -> None:
    """To this pipeline's next stage; in name order, the order the receiver reads them."""
    dst = _PP_RANKS[_PP_RANK + 1]
    for name in sorted(intermediate.tensors):
        dist.send(intermediate.tensors[name].contiguous(), dst)


def recv_intermediate_tensors(empty: IntermediateTensors) -> IntermediateTensors:
    """Fill `empty` from this pipeline's previous stage; both stages know the shapes, since
    every rank builds the same step's inputs."""
    src = _PP_RANKS[_PP_RANK - 1]
    for name in sorted(empty.tensors):
        dist.recv(empty.tensors[name], src)
    return empty


def broadcast_from_output_rank(x: torch.Tensor) -> torch.Tensor:
    """The output rank's `x`, on every rank (in place; returns it). Every rank must call it."""
    src = dist.get_world_size() - get_tensor_model_parallel_world_size()
    dist.broadcast(x, src)
    return x
