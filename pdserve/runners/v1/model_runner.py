"""Model Runner V1: a persistent batch with per-request cached state, prepared on the host."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from pdserve.runners.base import ModelRunnerBase
from pdserve.runners.draft_slots import num_valid_tokens, verified_ends
from pdserve.runners.inputs import build_step_inputs, to_device
from pdserve.runners.proposer import DraftStep
from pdserve.runners.rejection_sampler import DraftRows
from pdserve.runners.sampler import SamplingRow
from pdserve.runners.v1.input_batch import CachedRequestState, InputBatch
from pdserve.scheduler.output import SchedulerOutput


class ModelRunnerV1(ModelRunnerBase):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        super().__init__(config, device, use_sampling_kernels=False)
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(
            self.max_num_reqs, self.max_model_len, self.max_num_blocks_per_req
        )
        self.logits_processors = self.model_config.logits_processors

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
            self.prompt_logprobs.remove_request(req_id)
        # Unscheduled requests (preempted, or skipped this step) leave the batch but keep state.
        for req_id in [r for r in batch.req_ids if r not in so.num_scheduled_tokens]:
            batch.remove_request(req_id)

        for new in so.scheduled_new_reqs:
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            if new.prefill_token_ids is not None:
                state.output_token_ids = new.prefill_token_ids[len(new.prompt_token_ids) :]
            self.requests[new.req_id] = state
            batch.add_request(state)
            self.prompt_logprobs.add_request(
                new.req_id, new.sampling_params, new.prompt_token_ids, len(state.output_token_ids)
            )

        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            new_block_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed or self.draft_slots is None:
                # With speculation the runner keeps the count (runners/draft_slots.py).
                state.num_computed_tokens = cached.num_computed_tokens[i]
            if resumed:
                state.block_ids = list(new_block_ids or [])
            elif new_block_ids:
                state.block_ids.extend(new_block_ids)
            all_token_ids = cached.all_token_ids.get(req_id)
            if all_token_ids is not None:
                state.output_token_ids = all_token_ids[len(state.prompt_token_ids) :]
            if resumed:  # its first token may have been dropped (sampled while it was preempted)
                self.prompt_logprobs.add_request(
                    req_id,
                    state.sampling_params,
                    state.prompt_token_ids,
                    len(state.output_token_ids),
                )

            row = batch.req_id_to_index.get(req_id)
            if row is not None and resumed:
                # Preempted and resumed without a step between (its blocks are all new): its
                # row's block table goes, not only grows.
                batch.remove_request(req_id)
                row = None
            if row is None:
                batch.add_request(state)
                continue
            batch.num_computed_tokens[row] = state.num_computed_tokens
            if new_block_ids:
                batch.append_block_ids(row, new_block_ids)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        spec = so.scheduled_spec_decode_tokens or {}
        drafts, filled = self.place_drafts(spec, batch, batch.req_id_to_index)
        n = batch.num_reqs
        req_ids = list(batch.req_ids)
        num_scheduled = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        req_indices = np.repeat(np.arange(n), num_scheduled)
        cu_num_scheduled = np.cumsum(num_scheduled)
        offsets = np.arange(cu_num_scheduled[-1]) - np.repeat(
            cu_num_scheduled - num_scheduled, num_scheduled
        )
        positions = batch.num_computed_tokens[req_indices] + offsets
        input_ids = batch.token_ids[req_indices, positions]
        seq_lens = batch.num_computed_tokens[:n] + num_scheduled
        # A request samples once its scheduled tokens reach the end of everything it knows.
        sampling_rows = np.nonzero(seq_lens >= batch.num_tokens[:n])[0]

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return to_device(a, self.device)

        inputs = build_step_inputs(
            to_dev(input_ids),
            to_dev(positions),
            to_dev(req_indices),
            to_dev(num_scheduled),
            to_dev(seq_lens),
            to_dev(batch.block_table[:n]),
            self.block_size,
            to_dev(sampling_rows),
        )
        if self.has_state:  # a request's one block is its state's slot (state_cache.py)
            inputs.attn_metadata.state_slots = to_dev(batch.block_table[:n, 0].astype(np.int64))
        sampling_req_ids = [req_ids[i] for i in sampling_rows]
        rows = [self._sampling_row(self.requests[r]) for r in sampling_req_ids]
        prompt_chunks = None
        if self.prompt_logprobs.pending:
            starts = cu_num_scheduled - num_scheduled
            index = batch.req_id_to_index
            prompt_chunks = self.prompt_logprobs.chunks(
                (r, int(batch.num_computed_tokens[i]), int(num_scheduled[i]), int(starts[i]))
                for r in self.prompt_logprobs.pending
                if (i := index.get(r)) is not None
            )
        grammar = None if so.grammar_bitmask is None else (so.grammar_bitmask, sampling_req_ids)
        draft_rows = None
        if spec:
            span_ends = cu_num_scheduled[sampling_rows].tolist()
            ends = verified_ends(span_ends, sampling_req_ids, spec, drafts)
            draft_rows = DraftRows.build(drafts, sampling_req_ids, ends)
        sampled, logprobs = self.forward_and_sample(
            inputs, rows, prompt_chunks, grammar, draft_rows
        )
        tokens = dict(zip(sampling_req_ids, sampled))
        for row, req_id in zip(sampling_rows.tolist(), sampling_req_ids):
            self.requests[req_id].output_token_ids.extend(tokens[req_id])
            for token in tokens[req_id]:
                batch.append_token(row, token)
        num_valid = num_scheduled
        if self.draft_slots is not None:
            num_valid = num_valid_tokens(num_scheduled, batch.req_id_to_index, spec, tokens)
            batch.num_computed_tokens[:n] += num_valid
            for req_id, row_computed in zip(req_ids, batch.num_computed_tokens[:n].tolist()):
                self.requests[req_id].num_computed_tokens = row_computed
        proposals = None
        if self.draft is not None:  # EAGLE reads every step, sampled or not
            states = [self.requests[r] for r in sampling_req_ids]
            max_num_tokens = [
                self.max_num_tokens(len(s.prompt_token_ids), s.sampling_params) for s in states
            ]
            proposals = self.propose_drafts(
                DraftStep(
                    req_ids,
                    batch.token_ids[:n],
                    batch.num_tokens[:n].copy(),
                    batch.num_computed_tokens[:n] - num_valid,
                    num_valid,
                    cu_num_scheduled - num_scheduled,
                    batch.block_table[:n],
                    sampling_rows,
                    np.zeros(0, dtype=np.int64),
                ),
                np.array(max_num_tokens, dtype=np.int64),
                so.draft_paused_req_ids,
            )
        return self.make_output(
            req_ids, tokens, logprobs, sampling_req_ids, proposals, filled or None
        )

    def _sampling_row(self, state: CachedRequestState) -> SamplingRow:
        return SamplingRow(
            params=state.sampling_params,
            prompt_token_ids=state.prompt_token_ids,
            output_token_ids=state.output_token_ids,
            logits_processors=self.logits_processors,
        )
