"""Runner V2's request-state table: one fixed row per live request, tensors indexed by row."""

from __future__ import annotations

import torch

from pdserve.sampling_params import SamplingParams
from pdserve.scheduler.output import NewRequestData


class RequestStates:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, device: torch.device
    ) -> None:
        self.req_id_to_index: dict[str, int] = {}
        self.free_indices = list(range(max_num_reqs - 1, -1, -1))
        self.all_token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int64, device=device)
        self.num_computed_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(
            max_num_reqs, max_num_blocks_per_req, dtype=torch.int32, device=device
        )
        self.device = device
        # Host-side mirrors: lengths the scheduler and sampler read without a device sync.
        self.num_tokens = [0] * max_num_reqs
        self.num_blocks = [0] * max_num_reqs
        self.prompt_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.output_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs

    def add_request(self, new: NewRequestData) -> None:
        assert new.prefill_token_ids is not None, "runner V2 needs prefill_token_ids"
        idx = self.free_indices.pop()
        self.req_id_to_index[new.req_id] = idx
        tokens = new.prefill_token_ids
        self.all_token_ids[idx, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        self.num_tokens[idx] = len(tokens)
        # prefill_token_ids = prompt + outputs so far, when re-added after preemption.
        self.prompt_token_ids[idx] = new.prompt_token_ids
        self.output_token_ids[idx] = list(tokens[len(new.prompt_token_ids) :])
        self.sampling_params[idx] = new.sampling_params
        self.num_computed_tokens[idx] = new.num_computed_tokens
        self.num_blocks[idx] = 0
        self.append_block_ids(idx, new.block_ids)

    def remove_request(self, req_id: str) -> None:
        idx = self.req_id_to_index.pop(req_id, None)
        if idx is not None:
            self.sampling_params[idx] = None
            self.free_indices.append(idx)

    def append_block_ids(self, idx: int, block_ids: list[int]) -> None:
        start = self.num_blocks[idx]
        self.block_table[idx, start : start + len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self.num_blocks[idx] = start + len(block_ids)

    def append_sampled(self, idx: list[int], token_ids: list[int]) -> None:
        rows = torch.tensor(idx, dtype=torch.int64, device=self.device)
        cols = torch.tensor([self.num_tokens[i] for i in idx], dtype=torch.int64, device=self.device)
        self.all_token_ids[rows, cols] = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        for i, t in zip(idx, token_ids):
            self.num_tokens[i] += 1
            self.output_token_ids[i].append(t)
