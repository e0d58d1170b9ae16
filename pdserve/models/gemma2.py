"""Gemma2: the Llama decoder with Gemma's switches.

- Four norms per layer: attention and the MLP each between a pre-norm and a post-norm, the
  post-norm applied to its output before it joins the residual stream. Gemma's RMSNorm scales
  by (1 + weight): the checkpoint's weight plus one is loaded as the weight, so the norm kernels
  serve it unchanged (in float32 the same bits as HF's; in bf16, 1 + weight is rounded once).
- GeGLU (tanh GELU), embeddings scaled by sqrt(hidden_size) rounded to the activation dtype,
  the attention scale query_pre_attn_scalar^-0.5, attention scores and final logits soft-capped
  (cap * tanh(x / cap)), a sliding window on the layers config.layer_types calls
  "sliding_attention", tied embeddings.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.kernels.attention import AttentionMetadata
from pdserve.models.layers.decoder import GatedMLP, SelfAttention
from pdserve.models.layers.layernorm import RMSNorm
from pdserve.models.layers.rotary_embedding import RotaryEmbedding
from pdserve.models.llama import LlamaForCausalLM


class Gemma2DecoderLayer(nn.Module):
    """Pre-norm, attention, post-norm; pre-norm, MLP, post-norm; the residual left unsummed."""

    def __init__(
        self,
        self_attn: SelfAttention,
        mlp: GatedMLP,
        hf_config: PretrainedConfig,
        params_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, params_dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, params_dtype)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, params_dtype)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, params_dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, residual = self.self_attn.forward_after_norm(
            self.input_layernorm, positions, hidden_states, residual, kv_cache, attn_metadata
        )
        hidden_states, residual = self.pre_feedforward_layernorm(
            self.post_attention_layernorm(hidden_states), residual
        )
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    honours_sliding_window: ClassVar[bool] = True

    def _make_layer(self, layer_idx: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        cfg = self.config
        sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        attention = SelfAttention(
            cfg,
            rotary_emb,
            cfg.attention_bias,
            cfg.attention_bias,
            False,
            self.params_dtype,
            scale=cfg.query_pre_attn_scalar**-0.5,
            window=cfg.sliding_window if sliding else 0,
            softcap=cfg.attn_logit_softcapping or 0.0,
        )
        mlp = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation, False, self.params_dtype
        )
        return Gemma2DecoderLayer(attention, mlp, cfg, self.params_dtype)

    def _embedding_multiplier(self) -> float:
        # HF multiplies by the normalizer as a tensor of the activation dtype.
        normalizer = torch.tensor(
            self.config.hidden_size**0.5, dtype=self.params_dtype, device="cpu"
        )
        return normalizer.item()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.config.final_logit_softcapping
        return logits if not cap else (logits / cap).tanh() * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._norms_plus_one(weights))

    @staticmethod
    def _norms_plus_one(
        weights: Iterable[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name, (1.0 + tensor.float()) if name.endswith("norm.weight") else tensor
