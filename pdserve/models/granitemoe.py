"""GraniteMoE: Mixtral's decoder and experts with Granite's multipliers (the embeddings, what
each block adds to the residual stream, the attention scale, the logits) and its checkpoint
layout: a router named router.layer, each projection of all experts stacked in one tensor.

The router takes the top k logits and softmaxes them; softmax over all experts, top k and
renormalization (FusedMoE's) is the same distribution."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.models.layers.decoder import SelfAttention
from pdserve.models.layers.rotary_embedding import RotaryEmbedding
from pdserve.models.mixtral import MixtralForCausalLM


class GraniteMoeForCausalLM(MixtralForCausalLM):
    def _make_attention(self, rotary_emb: RotaryEmbedding) -> nn.Module:
        qkv_bias, o_bias = self._attention_biases()
        return SelfAttention(
            self.config,
            rotary_emb,
            qkv_bias,
            o_bias,
            self.qk_norm,
            self.params_dtype,
            scale=self.config.attention_multiplier,
        )

    def _embedding_multiplier(self) -> float:
        return self.config.embedding_multiplier

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.config.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._per_expert(weights))

    def _per_expert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stacked experts as Mixtral names them one by one (w1 gate, w3 up, w2 down)."""
        for name, tensor in weights:
            prefix = name.rsplit(".", 2)[0]
            if name.endswith(".input_linear.weight"):
                gate, up = tensor.chunk(2, dim=1)
                for e in range(tensor.shape[0]):
                    yield f"{prefix}.experts.{e}.w1.weight", gate[e]
                    yield f"{prefix}.experts.{e}.w3.weight", up[e]
            elif name.endswith(".output_linear.weight"):
                for e in range(tensor.shape[0]):
                    yield f"{prefix}.experts.{e}.w2.weight", tensor[e]
            else:
                yield name.replace(".router.layer.", ".gate."), tensor
