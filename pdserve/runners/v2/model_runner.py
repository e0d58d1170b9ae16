"""Model Runner V2: persistent per-request state decoupled from per-step inputs.

A preempted request is treated as finished (its row is freed); when rescheduled it arrives as
a new request whose `prefill_token_ids` carry prompt + outputs. Inputs are gathered by index.
"""

from __future__ import annotations

import torch

from pdserve.config import EngineConfig
from pdserve.kernels.input_prep import prepare_inputs
from pdserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from pdserve.runners.base import ModelRunnerBase, SamplingRow
from pdserve.runners.inputs import build_step_inputs
from pdserve.runners.v2.states import RequestStates
from pdserve.scheduler.output import SchedulerOutput


class ModelRunnerV2(ModelRunnerBase):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.states = RequestStates(
            self.max_num_reqs, self.max_model_len, self.max_num_blocks_per_req, device
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | (so.preempted_req_ids or set()):
            self.states.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self.states.add_request(new)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            idx = self.states.req_id_to_index[req_id]
            self.states.num_computed_tokens[idx] = cached.num_computed_tokens[i]
            if cached.new_block_ids[i]:
                self.states.append_block_ids(idx, cached.new_block_ids[i])

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        states = self.states
        # Decodes first: ascending scheduled token counts, as vLLM's V2 runner orders them.
        req_ids = sorted(so.num_scheduled_tokens, key=so.num_scheduled_tokens.__getitem__)
        idx = [states.req_id_to_index[r] for r in req_ids]
        query_lens_list = [so.num_scheduled_tokens[r] for r in req_ids]
        idx_mapping = torch.tensor(idx, dtype=torch.int64, device=self.device)
        query_lens = torch.tensor(query_lens_list, dtype=torch.int64, device=self.device)
        prepared = prepare_inputs(
            idx_mapping, query_lens, so.total_num_scheduled_tokens, states.all_token_ids,
            states.num_computed_tokens, states.block_table,
        )
        computed = states.num_computed_tokens[idx_mapping].tolist()
        sampling_pos = [
            i for i, (c, q, row) in enumerate(zip(computed, query_lens_list, idx))
            if c + q >= states.num_tokens[row]
        ]
        inputs = build_step_inputs(
            prepared.input_ids, prepared.positions, prepared.req_indices, query_lens,
            prepared.seq_lens, prepared.block_table, self.block_size,
            torch.tensor(sampling_pos, dtype=torch.int64, device=self.device),
        )
        sampling_req_ids = [req_ids[i] for i in sampling_pos]
        sampling_idx = [idx[i] for i in sampling_pos]
        rows = [
            SamplingRow(
                params=states.sampling_params[i],
                prompt_token_ids=states.prompt_token_ids[i],
                output_token_ids=states.output_token_ids[i],
            )
            for i in sampling_idx
        ]
        sampled, logprobs = self.forward_and_sample(inputs, rows)
        if sampled:
            states.append_sampled(sampling_idx, sampled)
        return self.make_output(req_ids, dict(zip(sampling_req_ids, sampled)), logprobs, sampling_req_ids)
