"""Qwen3.5 (its text model, `Qwen3_5ForCausalLM`): a hybrid of Gated DeltaNet layers
(layers/gated_deltanet.py, a recurrent state per request) and gated attention layers (paged
KV), in the order config.layer_types gives, each followed by Llama's gated MLP.

- Gated attention: q_proj yields each head's query and then its output gate (head_dim each);
  q and k are normalized per head; the first partial_rotary_factor of a head turns (rope over
  positions: for text, Qwen3.5's three mrope sections see the same position); the output is
  scaled by sigmoid(gate) before o_proj.
- Qwen3.5's RMSNorms scale by (1 + weight), loaded as the weight (as Gemma2's); the DeltaNet's
  gated norm scales by its weight alone.
- Model Runner V1 only (a hybrid, by the rule); one block a request holds the attention layers'
  KV and every DeltaNet layer's state (models/state_cache.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.distributed.parallel_state import IntermediateTensors
from pdserve.kernels.attention import AttentionMetadata
from pdserve.models.layers.attention import Attention
from pdserve.models.layers.decoder import DecoderLayer, head_dim_of
from pdserve.models.layers.gated_deltanet import CHUNK, GatedDeltaNet
from pdserve.models.layers.layernorm import RMSNorm
from pdserve.models.layers.linear import QKVParallelLinear, RowParallelLinear
from pdserve.models.layers.rotary_embedding import RotaryEmbedding
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.state_cache import StateModelCaches, StepPlan


class GatedSelfAttention(nn.Module):
    def __init__(
        self, hf_config: PretrainedConfig, rotary_emb: RotaryEmbedding, params_dtype: torch.dtype
    ) -> None:
        super().__init__()
        cfg = hf_config
        self.head_dim = head_dim_of(cfg)
        # Each head's query and gate, as q_proj lays them out: twice the heads to the projection
        # (a rank's share of them a whole number of heads, each its query and gate).
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            self.head_dim,
            2 * cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.attention_bias,
            params_dtype,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * self.head_dim,
            cfg.hidden_size,
            cfg.attention_bias,
            params_dtype,
        )
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, params_dtype)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, params_dtype)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)

    def forward_after_norm(
        self,
        norm: RMSNorm,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = norm.with_residual(x, residual)
        kv_size = self.num_kv_heads * self.head_dim
        q_size = 2 * self.num_heads * self.head_dim
        q_gate, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim)))
        q, k = self.rotary_emb(positions, q, k)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        out = self.attn(q, k, v, kv_cache, attn_metadata).flatten(1)
        return self.o_proj(out * torch.sigmoid(gate.flatten(1))), residual


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    honours_sliding_window = True  # no window: Qwen3.5's attention layers attend to all
    # A step of a prompt ends on a DeltaNet chunk's end, or at the prompt's (gated_deltanet.py).
    prompt_chunk_alignment: ClassVar[int] = CHUNK

    def _make_layer(self, layer_idx: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        cfg = self.config
        mixer: nn.Module
        if cfg.layer_types[layer_idx] == "linear_attention":
            mixer = GatedDeltaNet(cfg, self.params_dtype)
        else:
            mixer = GatedSelfAttention(cfg, rotary_emb, self.params_dtype)
        return DecoderLayer(mixer, self._make_mlp(layer_idx), cfg, self.params_dtype)

    def _deltanets(self) -> list[GatedDeltaNet]:
        return [
            layer.self_attn
            for layer in self.model.layers
            if isinstance(layer.self_attn, GatedDeltaNet)
        ]

    def state_shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per DeltaNet layer: the shapes of one request's (conv state, recurrent state)."""
        return [layer.state_shapes() for layer in self._deltanets()]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: StateModelCaches,
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        # Each layer its cache: an attention layer its KV view, a DeltaNet its states and
        # the step's plan (read once for every layer).
        plan = StepPlan.of(attn_metadata, input_ids.device)
        kv, state = iter(kv_caches.kv), iter(kv_caches.state)
        caches = [
            (*next(state), plan) if isinstance(layer.self_attn, GatedDeltaNet) else next(kv)
            for layer in self.model.layers
        ]
        return self.model(input_ids, positions, caches, attn_metadata, intermediate_tensors)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._renamed(weights))

    @staticmethod
    def _renamed(
        weights: Iterable[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Qwen3.5's (1 + weight) norms as plain weights; a DeltaNet is its layer's mixer."""
        for name, tensor in weights:
            if name.startswith(("mtp.", "model.visual.")):  # the MTP head; a VL checkpoint's
                continue
            if name.endswith("norm.weight") and ".linear_attn.norm." not in name:
                tensor = 1.0 + tensor.float()
            yield name.replace(".linear_attn.", ".self_attn."), tensor
