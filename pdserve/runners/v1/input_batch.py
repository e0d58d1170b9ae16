"""Runner V1's persistent batch: rows stay put across steps and are updated incrementally."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """A request the runner knows; kept while the request is preempted (not in the batch)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Rows [0, num_reqs) hold the scheduled requests; removal moves the last row into the hole."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int) -> None:
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, state: CachedRequestState) -> None:
        row = len(self.req_ids)
        self.req_ids.append(state.req_id)
        self.req_id_to_index[state.req_id] = row
        num_prompt = len(state.prompt_token_ids)
        self.token_ids[row, :num_prompt] = state.prompt_token_ids
        self.token_ids[row, num_prompt : state.num_tokens] = state.output_token_ids
        self.num_tokens[row] = state.num_tokens
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.set_block_ids(row, state.block_ids)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        last_id = self.req_ids.pop()
        if row != last:
            self.req_ids[row] = last_id
            self.req_id_to_index[last_id] = row
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.num_tokens[row] = n
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            nb = self.num_blocks[last]
            self.block_table[row, :nb] = self.block_table[last, :nb]
            self.num_blocks[row] = nb

    def set_block_ids(self, row: int, block_ids: list[int]) -> None:
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def known_tokens(self, row: int) -> np.ndarray:
        return self.token_ids[row, : self.num_tokens[row]]

    def write_drafts(self, row: int, drafts: list[int]) -> None:
        start = self.num_tokens[row]
        self.token_ids[row, start : start + len(drafts)] = drafts

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1
