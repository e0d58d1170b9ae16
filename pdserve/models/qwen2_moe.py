"""Qwen2-MoE: the Llama decoder (q/k/v bias) with sparse MoE blocks plus a gated shared expert."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.kernels.cpu.elementwise import sigmoid_mul
from pdserve.models.layers.decoder import GatedMLP
from pdserve.models.layers.fused_moe import FusedMoE
from pdserve.models.layers.linear import ReplicatedLinear
from pdserve.models.llama import LlamaForCausalLM


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, params_dtype: torch.dtype) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        self.gate = ReplicatedLinear(hidden_size, hf_config.num_experts, False, params_dtype)
        self.experts = FusedMoE(
            hf_config.num_experts,
            hf_config.num_experts_per_tok,
            hidden_size,
            hf_config.moe_intermediate_size,
            renormalize=hf_config.norm_topk_prob,
            params_dtype=params_dtype,
        )
        self.shared_expert = GatedMLP(
            hidden_size,
            hf_config.shared_expert_intermediate_size,
            hf_config.hidden_act,
            False,
            params_dtype,
        )
        self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, False, params_dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shared = sigmoid_mul(
            self.shared_expert_gate(hidden_states), self.shared_expert(hidden_states)
        )
        return self.experts(hidden_states, self.gate(hidden_states)) + shared


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    expert_params = {
        "gate_proj": ("w13_weight", "w1"),
        "up_proj": ("w13_weight", "w3"),
        "down_proj": ("w2_weight", "w2"),
    }

    def _attention_biases(self) -> tuple[bool, bool]:
        return bool(getattr(self.config, "qkv_bias", True)), False

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.config
        sparse = (
            layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0
            and (layer_idx + 1) % cfg.decoder_sparse_step == 0
        )
        if sparse:
            return Qwen2MoeSparseMoeBlock(cfg, self.params_dtype)
        return super()._make_mlp(layer_idx)
