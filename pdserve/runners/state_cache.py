"""The state of models with recurrent layers (Mamba): a fixed-size slot per running request.

The slots are the KV cache's blocks: a state model's block holds one request's whole state and
its block size is max_model_len (EngineConfig sets it), so every request takes one block at
admission and keeps it across chunks and decode steps, and the scheduler's block pool accounts
for the state as it does for KV: freed when the request finishes, aborts or is preempted, its
memory the cache budget's. A request with no context (new, or recomputed after preemption)
starts from zeros: the model zeroes its slot. vLLM's Mamba layers take one block per request
the same way.
"""

from __future__ import annotations

import math

import torch

# Per layer: the shapes of one request's (conv state, SSM state).
StateShapes = list[tuple[tuple[int, ...], tuple[int, ...]]]


def make_state_caches(
    shapes: StateShapes, num_slots: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, its (conv, SSM) states for `num_slots` requests: the SSM state in float32,
    which its scan runs in."""
    return [
        (
            torch.zeros(num_slots, *conv, dtype=dtype, device=device),
            torch.zeros(num_slots, *ssm, dtype=torch.float32, device=device),
        )
        for conv, ssm in shapes
    ]


def slot_bytes(shapes: StateShapes, dtype: torch.dtype) -> int:
    """One request's state, every layer, as make_state_caches lays it out."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(conv) * size + math.prod(ssm) * 4 for conv, ssm in shapes)
