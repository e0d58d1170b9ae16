"""Mixtral: the Llama decoder with a sparse MoE block (top-k renormalized) as every MLP."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.models.layers.activation import check_gated_act
from pdserve.models.layers.fused_moe import FusedMoE
from pdserve.models.layers.linear import ReplicatedLinear
from pdserve.models.llama import LlamaForCausalLM


class MixtralMoE(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, params_dtype: torch.dtype) -> None:
        super().__init__()
        check_gated_act(hf_config.hidden_act)
        num_experts = hf_config.num_local_experts
        self.gate = ReplicatedLinear(hf_config.hidden_size, num_experts, False, params_dtype)
        self.experts = FusedMoE(
            num_experts,
            hf_config.num_experts_per_tok,
            hf_config.hidden_size,
            hf_config.intermediate_size,
            renormalize=True,
            params_dtype=params_dtype,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MixtralForCausalLM(LlamaForCausalLM):
    expert_params = {
        "w1": ("w13_weight", "w1"),
        "w3": ("w13_weight", "w3"),
        "w2": ("w2_weight", "w2"),
    }

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        return MixtralMoE(self.config, self.params_dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # The checkpoint calls the MoE block block_sparse_moe; the shared decoder layer, mlp.
        super().load_weights((n.replace(".block_sparse_moe.", ".mlp."), t) for n, t in weights)
