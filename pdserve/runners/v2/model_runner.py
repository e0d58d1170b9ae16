"""Model Runner V2: persistent per-request state decoupled from per-step inputs.

A preempted request is treated as finished (its row is freed); when rescheduled it arrives as
a new request whose `prefill_token_ids` carry prompt + outputs. Inputs are gathered by index.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.kernels import backend
from pdserve.kernels.input_prep import prepare_inputs
from pdserve.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from pdserve.runners.base import ModelRunnerBase
from pdserve.runners.draft_slots import num_valid_tokens, verified_ends
from pdserve.runners.inputs import StepInputs, step_inputs_from_prepared, to_device
from pdserve.runners.proposer import DraftStep
from pdserve.runners.rejection_sampler import DraftRows
from pdserve.runners.sampler import SamplingRow
from pdserve.runners.v2.cudagraph import CudaGraphModel, StaticInputs, batch_descriptors
from pdserve.runners.v2.states import RequestStates
from pdserve.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunnerV2(ModelRunnerBase):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        super().__init__(config, device, use_sampling_kernels=True)
        self.states = RequestStates(
            self.max_num_reqs, self.max_model_len, self.max_num_blocks_per_req, device
        )
        self.cudagraphs: CudaGraphModel | None = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        super().initialize_kv_cache(num_blocks)
        if self._use_cudagraphs():
            assert self.model is not None, "load_model() first"
            sched = self.config.scheduler_config
            descriptors = batch_descriptors(sched.max_num_seqs, sched.max_num_batched_tokens)
            static = StaticInputs(
                max(d.num_tokens for d in descriptors),
                self.max_num_blocks_per_req,
                self.max_model_len,
                self.device,
            )
            self.cudagraphs = CudaGraphModel(self.model, static, descriptors)
            self.cudagraphs.capture(self.kv_caches)
            self.model = self.cudagraphs

    def _use_cudagraphs(self) -> bool:
        if self.device.type != "cuda" or self.model_config.enforce_eager:
            return False
        # The torch references sync with the host (data-dependent shapes), as does the MoE
        # layer's per-expert loop: a graph cannot capture them.
        if not backend.use_triton(self.device):
            logger.info("CUDA graphs off: PDSERVE_KERNEL_BACKEND=torch")
            return False
        if self.model_config.is_moe:
            logger.info("CUDA graphs off: the MoE layer syncs with the host")
            return False
        if self.draft_slots is not None:
            # A drafting step's decodes have 1 + k tokens, and the drafter's passes run eager.
            logger.info("CUDA graphs off: speculative decoding")
            return False
        if self.config.parallel_config.pipeline_parallel_size > 1:
            # A stage's graph would have to take the received activations as static inputs.
            logger.info("CUDA graphs off: pipeline parallelism")
            return False
        return True

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | (so.preempted_req_ids or set()):
            self.states.remove_request(req_id)
        for req_id in so.finished_req_ids:
            self.prompt_logprobs.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self.states.add_request(new)
            prefill = new.prefill_token_ids or new.prompt_token_ids
            num_output_tokens = len(prefill) - len(new.prompt_token_ids)
            self.prompt_logprobs.add_request(
                new.req_id, new.sampling_params, new.prompt_token_ids, num_output_tokens
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            idx = self.states.req_id_to_index[req_id]
            if self.draft_slots is None:  # else the runner keeps the count (draft_slots.py)
                self.states.num_computed_tokens_np[idx] = cached.num_computed_tokens[i]
            if cached.new_block_ids[i]:
                self.states.append_block_ids(idx, cached.new_block_ids[i])

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        states = self.states
        # Decodes first: ascending scheduled token counts, as vLLM's V2 runner orders them.
        req_ids = sorted(so.num_scheduled_tokens, key=so.num_scheduled_tokens.__getitem__)
        idx = np.array([states.req_id_to_index[r] for r in req_ids], dtype=np.int64)
        query_lens = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        spec = so.scheduled_spec_decode_tokens or {}
        drafts, filled = self.place_drafts(spec, states, states.req_id_to_index)
        # A request samples once its scheduled tokens reach the end of everything it knows.
        seq_lens = states.num_computed_tokens_np[idx] + query_lens
        sampling_pos = np.nonzero(seq_lens >= states.num_tokens[idx])[0]
        inputs = self._prepare_inputs(idx, query_lens, seq_lens, sampling_pos)
        if self.cudagraphs is not None:
            inputs = self.cudagraphs.pad(inputs)
        sampling_idx = idx[sampling_pos].tolist()
        sampling_req_ids = [req_ids[i] for i in sampling_pos]
        rows = [
            SamplingRow(
                params=states.sampling_params[i],
                prompt_token_ids=states.prompt_token_ids[i],
                output_token_ids=states.output_token_ids[i],
            )
            for i in sampling_idx
        ]
        prompt_chunks = None
        if self.prompt_logprobs.pending:
            position = dict(zip(req_ids, range(len(req_ids))))
            starts = np.cumsum(query_lens) - query_lens
            prompt_chunks = self.prompt_logprobs.chunks(
                (r, int(seq_lens[j] - query_lens[j]), int(query_lens[j]), int(starts[j]))
                for r in self.prompt_logprobs.pending
                if (j := position.get(r)) is not None
            )
        grammar = None if so.grammar_bitmask is None else (so.grammar_bitmask, sampling_req_ids)
        starts = np.cumsum(query_lens) - query_lens
        draft_rows = None
        if spec:
            span_ends = (starts + query_lens)[sampling_pos].tolist()
            ends = verified_ends(span_ends, sampling_req_ids, spec, drafts)
            draft_rows = DraftRows.build(drafts, sampling_req_ids, ends)
        sampled, logprobs = self.forward_and_sample(
            inputs, rows, prompt_chunks, grammar, draft_rows
        )
        if sampled:
            states.append_sampled(sampling_idx, sampled)
        tokens = dict(zip(sampling_req_ids, sampled))
        if self.draft_slots is None:
            return self.make_output(req_ids, tokens, logprobs, sampling_req_ids)
        position = dict(zip(req_ids, range(len(req_ids))))
        num_valid = num_valid_tokens(query_lens, position, spec, tokens)
        num_computed = states.num_computed_tokens_np[idx]  # before the step
        states.num_computed_tokens_np[idx] = num_computed + num_valid
        proposals = None
        if self.draft is not None:
            step = DraftStep(
                req_ids,
                states.token_ids_np[idx, : int(states.num_tokens[idx].max())],
                states.num_tokens[idx],
                num_computed,
                num_valid,
                starts,
                states.block_table_np[idx],
                sampling_pos,
                np.zeros(0, dtype=np.int64),
            )
            max_num_tokens = [
                self.max_num_tokens(len(states.prompt_token_ids[i]), states.sampling_params[i])
                for i in sampling_idx
            ]
            proposals = self.propose_drafts(
                step, np.array(max_num_tokens, dtype=np.int64), so.draft_paused_req_ids
            )
        return self.make_output(
            req_ids, tokens, logprobs, sampling_req_ids, proposals, filled or None
        )

    def _prepare_inputs(
        self,
        idx: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        sampling_pos: np.ndarray,
    ) -> StepInputs:
        """The step's inputs: what the host knows from the scheduler output (batch rows, query
        offsets, sampled positions) goes to the device in one copy, the rest is gathered there
        from the state table. Nothing is read back."""
        states = self.states
        states.commit()
        num_reqs = idx.shape[0]
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        logits_indices = query_start_loc[1:][sampling_pos] - 1
        packed = to_device(np.concatenate([idx, query_start_loc, logits_indices]), self.device)
        query_start_loc_dev = packed[num_reqs : 2 * num_reqs + 1].to(torch.int32)
        num_tokens = int(query_start_loc[-1])
        prepared = prepare_inputs(
            packed[:num_reqs],
            query_start_loc_dev,
            num_tokens,
            states.all_token_ids,
            states.num_computed_tokens,
            states.block_table,
            self.block_size,
        )
        return step_inputs_from_prepared(
            prepared,
            query_start_loc_dev,
            int(query_lens.max()),
            int(seq_lens.max()),
            packed[2 * num_reqs + 1 :],
        )
