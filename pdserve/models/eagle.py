"""EAGLE's draft head for a Llama-family target (vLLM's EagleLlamaForCausalLM behaviour).

At position t the head reads the token at t + 1 and the target's final hidden state at t:
fc(concat(embed(token), hidden)) -> Llama decoder layers (the first without its input norm)
-> the residual sum, with no final norm; the target's LM head turns that into the guess for the
token at t + 2, and the sum is the hidden state the head's next guess reads. The embedding and
the LM head are the target's (a checkpoint's own copies are skipped). The head's attention
layers keep KV like the target's, in the target's blocks (runners/eagle.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.kernels.attention import AttentionMetadata
from pdserve.models.layers.decoder import DecoderLayer, GatedMLP, SelfAttention, head_dim_of
from pdserve.models.layers.linear import ReplicatedLinear
from pdserve.models.layers.rotary_embedding import get_rope, get_rope_parameters
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.utils import load_checkpoint_weights


class EagleLlamaHead(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        hidden = hf_config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, False, dtype)
        rotary_emb = get_rope(
            head_dim_of(hf_config),
            get_rope_parameters(hf_config),
            getattr(hf_config, "max_position_embeddings", None) or 2048,
            dtype,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                SelfAttention(hf_config, rotary_emb, False, False, False, dtype),
                GatedMLP(hidden, hf_config.intermediate_size, hf_config.hidden_act, False, dtype),
                hf_config,
                dtype,
            )
            for _ in range(hf_config.num_hidden_layers)
        )
        # EAGLE's first layer reads fc's output as it is.
        del self.layers[0].input_layernorm
        # The target's embedding and LM head, not parameters of the head (bind_target).
        self._target: tuple[LlamaForCausalLM] | None = None

    def bind_target(self, target: nn.Module) -> None:
        self._target = (target,)  # type: ignore[assignment]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        assert self._target is not None, "bind_target() first"
        embeds = self._target[0].model.embed_tokens(input_ids)
        x = self.fc(torch.cat((embeds, hidden_states.to(embeds.dtype)), dim=-1))
        first = self.layers[0]
        residual = x
        x = first.self_attn(positions, x, kv_caches[0], attn_metadata)
        x, residual = first.mlp.forward_after_norm(first.post_attention_layernorm, x, residual)
        for layer, kv_cache in zip(self.layers[1:], kv_caches[1:], strict=True):
            x, residual = layer(positions, x, residual, kv_cache, attn_metadata)
        return x + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self._target is not None, "bind_target() first"
        return self._target[0].compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = (
            (name.removeprefix("model."), tensor)
            for name, tensor in weights
            if not name.endswith(("embed_tokens.weight", "lm_head.weight"))
        )
        load_checkpoint_weights(self, own, stacked_params=LlamaForCausalLM.stacked_params)
