"""Speculative decoding with an EAGLE head (runner V1; models/eagle.py has the head, and
runners/proposer.py what model-based drafters share).

At position t the head reads the token at t + 1 and the target's hidden state at t, so it runs
once a step's tokens are known: over each request's positions of the step that hold the right
tokens (a prompt chunk's all, with the next prompt token; a decode's up to its last accepted
draft, with the token sampled after it). That pass writes the head's KV for them, and the
sampling requests' last positions give the first guesses. Each further pass reads the guess
before it and, for want of the target's hidden state there, the head's own output.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.kernels.linear import pack_linear_weights
from pdserve.kernels.sampling import argmax_rows
from pdserve.models import loader
from pdserve.models.eagle import EagleLlamaHead
from pdserve.runners.inputs import StepInputs, build_step_inputs, to_device
from pdserve.runners.proposer import DraftStep, chain_guesses


class EagleProposer:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.method == "eagle"
        self.source, self.hf_config = spec.eagle_source, spec.eagle_config
        self.k = spec.num_speculative_tokens
        self.device, self.dtype = device, dtype
        self.block_size = config.cache_config.block_size
        self.head: EagleLlamaHead | None = None
        self.num_layers = self.hf_config.num_hidden_layers
        self.kv_caches: list[torch.Tensor] = []
        self.hidden: torch.Tensor | None = None  # the target's, of the step just run

    def load(self, target: torch.nn.Module) -> None:
        head = loader.load_model(
            self.hf_config, self.source, self.dtype, self.device, model_cls=EagleLlamaHead
        )
        assert isinstance(head, EagleLlamaHead)
        head.bind_target(target)
        pack_linear_weights(head)
        self.head = head

    def observe(self, inputs: StepInputs, hidden: torch.Tensor | None) -> None:
        self.hidden = hidden

    def propose(self, step: DraftStep) -> list[list[int]]:
        head, hidden = self.head, self.hidden
        assert head is not None and hidden is not None
        self.hidden = None
        num_rows = len(step.req_ids)
        drafting = step.num_drafts > 0  # of the sampling rows: paused ones guess nothing
        counts = step.num_valid
        rows_of_token = np.repeat(np.arange(num_rows), counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        positions = step.num_computed[rows_of_token] + offsets
        flat = step.starts[rows_of_token] + offsets
        device = self.device
        inputs = build_step_inputs(
            to_device(step.token_ids[rows_of_token, positions + 1], device),
            to_device(positions, device),
            to_device(rows_of_token, device),
            to_device(counts.astype(np.int64), device),
            to_device(step.num_computed + counts, device),
            to_device(step.block_table, device),
            self.block_size,
            to_device(step.sampling[drafting], device),
        )
        out = head(
            inputs.input_ids,
            inputs.positions,
            hidden[to_device(flat, device)],
            self.kv_caches,
            inputs.attn_metadata,
        )
        if not drafting.any():
            return [[] for _ in step.sampling]
        state = out[inputs.logits_indices]  # each drafting row's last position
        first = iter(argmax_rows(head.compute_logits(state)).tolist())

        def next_guesses(one: StepInputs, kept: np.ndarray) -> torch.Tensor:
            nonlocal state
            state = state[to_device(np.nonzero(kept)[0], device)]
            state = head(one.input_ids, one.positions, state, self.kv_caches, one.attn_metadata)
            return argmax_rows(head.compute_logits(state))

        guesses = [[next(first)] if d else [] for d in drafting.tolist()]
        return chain_guesses(guesses, step, self.block_size, device, next_guesses, lag=1)
