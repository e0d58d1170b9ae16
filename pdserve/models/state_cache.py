"""The state of models with recurrent layers (Mamba): a fixed-size slot per running request,
stored in the request's KV block.

A state model's block size is max_model_len (EngineConfig sets it), so every request takes one
block at admission and keeps it across chunks and decode steps. The block holds its attention
layers' keys and values (a hybrid's) and then, in rows of the same size appended after them,
the request's whole state: every layer's convolution state (in the model's dtype) and SSM state
(in float32, which its scan runs in). So the scheduler's block pool accounts for the state as it
does for KV (freed when the request finishes, aborts or is preempted, its memory the cache
budget's), and whatever moves a block (the KV connector's transfers, host staging, block copies)
moves the state with it. A request with no context (new, or recomputed after preemption) starts
from zeros: the model zeroes its slot. vLLM's Mamba layers take one block per request the same
way, and its hybrid allocator pads a state page to an attention page's size as the rows do here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pdserve.kernels.attention import AttentionMetadata

# Per layer: the shapes of one request's (conv state, SSM state).
StateShapes = list[tuple[tuple[int, ...], tuple[int, ...]]]
StateCaches = list[tuple[torch.Tensor, torch.Tensor]]


class StateModelCaches(NamedTuple):
    """What a state model's forward gets: its attention layers' KV views (a hybrid's) and its
    state layers' (conv, SSM) states."""

    kv: list[torch.Tensor]
    state: StateCaches


_ALIGN = 16  # every state tensor starts on a 16-byte boundary of its block


def _offsets(shapes: StateShapes, dtype: torch.dtype) -> tuple[list[tuple[int, int]], int]:
    """Per layer, the byte offsets of its (conv, SSM) states in a slot; and the slot's bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    offsets, end = [], 0
    for conv, ssm in shapes:
        conv_at = end
        ssm_at = _align(conv_at + math.prod(conv) * size)
        end = _align(ssm_at + math.prod(ssm) * 4)
        offsets.append((conv_at, ssm_at))
    return offsets, end


def _align(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def slot_bytes(shapes: StateShapes, dtype: torch.dtype) -> int:
    """One request's state, every layer, as state_views lays it out."""
    return _offsets(shapes, dtype)[1]


def num_state_rows(shapes: StateShapes, dtype: torch.dtype, row_bytes: int) -> int:
    """The rows of `row_bytes` (one attention layer's share of a block) the state takes."""
    return -(-slot_bytes(shapes, dtype) // row_bytes)


def state_views(rows: torch.Tensor, shapes: StateShapes, dtype: torch.dtype) -> StateCaches:
    """Per layer, its (conv, SSM) states of every block, [num_blocks, *shape] views into the
    blocks' state rows `rows` ([num_blocks, rows...], each block's rows contiguous)."""
    num_blocks = rows.shape[0]
    block = rows.reshape(num_blocks, -1).view(torch.uint8)
    offsets, end = _offsets(shapes, dtype)
    assert end <= block.shape[1], f"a slot of {end} bytes in {block.shape[1]} bytes of rows"

    def view(at: int, shape: tuple[int, ...], of: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=of).element_size()
        return block[:, at : at + nbytes].view(of).view(num_blocks, *shape)

    return [
        (view(conv_at, conv, dtype), view(ssm_at, ssm, torch.float32))
        for (conv, ssm), (conv_at, ssm_at) in zip(shapes, offsets, strict=True)
    ]


def describe(shapes: StateShapes, dtype: torch.dtype) -> str:
    """The layout two instances must share to hand state over (the handshake compares it)."""
    counts: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for pair in shapes:
        counts[pair] = counts.get(pair, 0) + 1
    name = str(dtype).removeprefix("torch.")
    return "; ".join(
        f"{n} x (conv {list(conv)} {name}, ssm {list(ssm)} float32)"
        for (conv, ssm), n in counts.items()
    )


@dataclass
class StepPlan:
    """How a step's requests meet their states, read once for every layer: the slots to zero
    first, the prompts' (rows, slot) scanned one by one, the one-token steps that continue a
    state (their rows and slots) run batched."""

    fresh_slots: torch.Tensor
    prompts: list[tuple[slice, int]]
    decode_rows: torch.Tensor
    decode_slots: torch.Tensor

    @classmethod
    def of(cls, md: AttentionMetadata, device: torch.device) -> StepPlan:
        assert md.state_slots is not None, "a state model's step names each request's slot"
        starts = md.query_start_loc.tolist()
        seq_lens = md.seq_lens[: md.num_reqs].tolist()
        fresh, prompts, decodes = [], [], []
        for i, slot in enumerate(md.state_slots.tolist()):
            num_tokens = starts[i + 1] - starts[i]
            context = seq_lens[i] - num_tokens
            if context == 0:
                fresh.append(slot)
            if num_tokens == 1 and context > 0:
                decodes.append((starts[i], slot))
            else:
                prompts.append((slice(starts[i], starts[i + 1]), slot))
        rows, slots = zip(*decodes, strict=True) if decodes else ((), ())

        def tensor(values: list[int] | tuple[int, ...]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(tensor(fresh), prompts, tensor(rows), tensor(slots))

    def run(
        self,
        x: torch.Tensor,
        out_features: int,
        states: tuple[torch.Tensor, torch.Tensor],
        prompt: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        step: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """A state layer's step over x [T, hidden]: the fresh slots zeroed, each prompt through
        `prompt(rows, conv state, SSM state)` (its slot's views, updated in place), the one-token
        steps at once through `step(rows, conv states, SSM states, slots)` (the SSM states
        updated in place at `slots`; the new conv states returned). Padding rows stay 0."""
        conv_states, ssm_states = states
        if self.fresh_slots.numel():  # new prompts, or ones recomputed after preemption
            conv_states[self.fresh_slots] = 0
            ssm_states[self.fresh_slots] = 0
        out = x.new_zeros(x.shape[0], out_features)
        for rows, slot in self.prompts:
            out[rows] = prompt(x[rows], conv_states[slot], ssm_states[slot])
        if self.decode_rows.numel():
            rows, slots = self.decode_rows, self.decode_slots
            out[rows], conv = step(x[rows], conv_states[slots], ssm_states, slots)
            conv_states[slots] = conv
        return out
