"""Runner V2's request-state table: one fixed row per live request, tensors indexed by row.

The tables the input-prep kernel reads live on the device; the host keeps mirrors of the
lengths it needs (which requests sample, how long each sequence is), so that preparing a step
never reads the device. Host-to-device writes go through `copy_to_device` and `to_device`,
which never wait for the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from pdserve.runners.inputs import to_device
from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.output import NewRequestData


def copy_to_device(dst: torch.Tensor, values: Sequence[int] | np.ndarray) -> None:
    """dst[:] = values, without a host sync on CUDA."""
    src = torch.as_tensor(values, dtype=dst.dtype)
    if dst.is_cuda:
        # Staged through a fresh pinned buffer, so the copy is asynchronous; the caching host
        # allocator keeps the buffer until the copy has run, so the host may move on at once.
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


class RequestStates:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        self.req_id_to_index: dict[str, int] = {}
        self.free_indices = list(range(max_num_reqs - 1, -1, -1))
        self.all_token_ids = torch.zeros(
            max_num_reqs, max_model_len, dtype=torch.int64, device=device
        )
        self.block_table = torch.zeros(
            max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device
        )
        self.device = device
        # The host's copies of the token and block tables, which the drafters read
        # (runners/proposer.py): on the CPU device the tables themselves.
        self.mirrored = device.type != "cpu"
        if self.mirrored:
            self.token_ids_np = np.zeros(tuple(self.all_token_ids.shape), dtype=np.int64)
            self.block_table_np = np.zeros(tuple(self.block_table.shape), dtype=np.int32)
        else:
            self.token_ids_np = self.all_token_ids.numpy()
            self.block_table_np = self.block_table.numpy()
        # Written on the host as the scheduler reports it, sent to the device once per step by
        # commit() (the CPU device shares the host array, so nothing is sent).
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int64)
        if device.type == "cpu":
            self.num_computed_tokens = torch.from_numpy(self.num_computed_tokens_np)
        else:
            self.num_computed_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        # Host-side only: lengths the runner reads without a device sync.
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_blocks = [0] * max_num_reqs
        self.prompt_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.output_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs

    def add_request(self, new: NewRequestData) -> None:
        assert new.prefill_token_ids is not None, "runner V2 needs prefill_token_ids"
        idx = self.free_indices.pop()
        self.req_id_to_index[new.req_id] = idx
        tokens = new.prefill_token_ids
        copy_to_device(self.all_token_ids[idx, : len(tokens)], tokens)
        if self.mirrored:
            self.token_ids_np[idx, : len(tokens)] = tokens
        self.num_tokens[idx] = len(tokens)
        # prefill_token_ids = prompt + outputs so far, when re-added after preemption.
        self.prompt_token_ids[idx] = new.prompt_token_ids
        self.output_token_ids[idx] = list(tokens[len(new.prompt_token_ids) :])
        self.sampling_params[idx] = new.sampling_params
        self.num_computed_tokens_np[idx] = new.num_computed_tokens
        self.num_blocks[idx] = 0
        self.append_block_ids(idx, new.block_ids)

    def remove_request(self, req_id: str) -> None:
        idx = self.req_id_to_index.pop(req_id, None)
        if idx is not None:
            self.sampling_params[idx] = None
            self.free_indices.append(idx)

    def append_block_ids(self, idx: int, block_ids: list[int]) -> None:
        start = self.num_blocks[idx]
        if block_ids:
            copy_to_device(self.block_table[idx, start : start + len(block_ids)], block_ids)
            if self.mirrored:
                self.block_table_np[idx, start : start + len(block_ids)] = block_ids
        self.num_blocks[idx] = start + len(block_ids)

    def commit(self) -> None:
        """Send this step's num_computed_tokens to the device (before preparing inputs)."""
        if self.num_computed_tokens.device.type != "cpu":
            copy_to_device(self.num_computed_tokens, self.num_computed_tokens_np)

    def known_tokens(self, idx: int) -> np.ndarray:
        return self.token_ids_np[idx, : self.num_tokens[idx]]

    def write_drafts(self, idx: int, drafts: list[int]) -> None:
        """A step's drafts, after the request's known tokens (not counted among them)."""
        start = int(self.num_tokens[idx])
        copy_to_device(self.all_token_ids[idx, start : start + len(drafts)], drafts)
        if self.mirrored:
            self.token_ids_np[idx, start : start + len(drafts)] = drafts

    def append_sampled(self, idx: list[int], token_ids: list[list[int]]) -> None:
        """Each row's tokens of the step (one, or with drafts its accepted ones and one more)."""
        rows = np.asarray(idx, dtype=np.int64)
        counts = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
        tokens = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64)
        starts = np.cumsum(counts) - counts
        row_of = np.repeat(rows, counts)
        cols = np.repeat(self.num_tokens[rows] - starts, counts) + np.arange(len(tokens))
        packed = to_device(np.stack([row_of, cols, tokens]), self.device)
        self.all_token_ids[packed[0], packed[1]] = packed[2]
        if self.mirrored:
            self.token_ids_np[row_of, cols] = tokens
        self.num_tokens[rows] += counts
        for i, t in zip(idx, token_ids):
            self.output_token_ids[i].extend(t)
