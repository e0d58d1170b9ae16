"""Speculative decoding with a draft model (runner V1): a second, cheaper model of the same
vocabulary guesses each request's next k tokens (runners/proposer.py has what model-based
drafters share).

It runs on each step's tokens as the target does, so its KV covers the prompt and every
verified token (rejected drafts' KV is written over later, like the target's). After the step
its passes start from each sampling request's last token.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.kernels.linear import pack_linear_weights
from pdserve.kernels.sampling import argmax_rows
from pdserve.models import loader
from pdserve.models.utils import kv_cache_geometry
from pdserve.runners.inputs import StepInputs
from pdserve.runners.proposer import DraftStep, chain_guesses


class DraftModel:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.method == "draft_model"
        self.model_config = spec.draft_model_config
        self.k = spec.num_speculative_tokens
        self.device, self.dtype = device, dtype
        self.block_size = config.cache_config.block_size
        self.model: torch.nn.Module | None = None
        self.num_layers = 0
        self.kv_caches: list[torch.Tensor] = []

    def load(self, target: torch.nn.Module) -> None:
        mc = self.model_config
        self.model = loader.load_model(mc.hf_config, mc.source, self.dtype, self.device)
        pack_linear_weights(self.model)
        self.num_layers = kv_cache_geometry(self.model).num_layers

    def observe(self, inputs: StepInputs, hidden: torch.Tensor | None) -> None:
        """The step's tokens through the draft model: their KV in its layers."""
        assert self.model is not None
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)

    def propose(self, step: DraftStep) -> list[list[int]]:
        model = self.model
        assert model is not None

        def next_guesses(inputs: StepInputs, kept: np.ndarray) -> torch.Tensor:
            hidden = model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
            return argmax_rows(model.compute_logits(hidden))

        guesses: list[list[int]] = [[] for _ in step.sampling]
        return chain_guesses(guesses, step, self.block_size, self.device, next_guesses)
