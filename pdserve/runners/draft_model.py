"""Speculative decoding with a draft model (runner V1): a second, cheaper model guesses each
request's next k tokens, the target verifies them (rejection_sampler.py).

Its KV lives in the target's blocks, in layers after the target's: one budget, one block table
and one pool for both, and whatever moves a block (the split's pull or push) moves the draft's
KV of the prompt with the target's. Each step the draft model runs on the step's tokens as the
target does (so its KV covers the prompt and every verified token; rejected drafts' KV is
written over later, like the target's). After the step it guesses k tokens for each request
that sampled, from the token just sampled: k passes of one token each, greedy (a one-hot
proposal, which the rejection sampler's rule for sampled requests assumes). Those passes write
KV past the request's tokens: the scheduler holds k lookahead slots per request for them.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.kernels.linear import pack_linear_weights
from pdserve.kernels.sampling import argmax_rows
from pdserve.models import loader
from pdserve.models.utils import kv_cache_geometry
from pdserve.runners.inputs import StepInputs, build_step_inputs


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

    def load(self) -> None:
        mc = self.model_config
        self.model = loader.load_model(mc.hf_config, mc.source, self.dtype, self.device)
        pack_linear_weights(self.model)
        self.num_layers = kv_cache_geometry(self.model).num_layers

    def run(self, inputs: StepInputs) -> None:
        """The step's tokens through the draft model: their KV in its layers."""
        assert self.model is not None
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)

    def propose(
        self,
        last_tokens: np.ndarray,
        num_tokens: np.ndarray,
        block_table: np.ndarray,
        num_drafts: np.ndarray,
    ) -> list[list[int]]:
        """`num_drafts[i]` greedy guesses for request i after its last token (`num_tokens[i]`
        known, the last one's KV not computed yet). The passes write KV at positions
        num_tokens - 1 .. num_tokens + num_drafts - 2: within the lookahead slots, and below
        max_model_len where num_drafts leaves room for the next token and the guesses."""
        assert self.model is not None
        guesses: list[list[int]] = [[] for _ in range(len(last_tokens))]
        tokens = last_tokens.astype(np.int64)
        positions = num_tokens.astype(np.int64) - 1
        rows = np.arange(len(last_tokens))
        for j in range(int(num_drafts.max(initial=0))):
            rows = rows[num_drafts[rows] > j]
            m = len(rows)

            def to_dev(a: np.ndarray) -> torch.Tensor:
                return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

            ones = np.ones(m, dtype=np.int64)
            inputs = build_step_inputs(
                to_dev(tokens[rows]),
                to_dev(positions[rows]),
                to_dev(np.arange(m)),
                to_dev(ones),
                to_dev(positions[rows] + 1),
                to_dev(block_table[rows]),
                self.block_size,
                to_dev(np.arange(m)),
            )
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
            )
            guess = argmax_rows(self.model.compute_logits(hidden)).cpu().numpy()
            for row, token in zip(rows.tolist(), guess.tolist()):
                guesses[row].append(token)
            tokens[rows] = guess
            positions[rows] += 1
        return guesses
