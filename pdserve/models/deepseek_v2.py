"""DeepSeek-V2 and V3: the Llama decoder with multi-head latent attention (layers/mla.py), dense
MLPs in the first `first_k_dense_replace` layers and DeepSeek's MoE after: routed experts chosen
by group-limited top-k (fused_moe.grouped_topk), scaled by routed_scaling_factor, plus shared
experts every token goes through.

V3 differs in its routing (sigmoid scores, a correction bias that steers the choice) and may
rotate its rope pairs rotate-half style (rope_interleave false); its attention and cache are V2's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.models.layers.decoder import GatedMLP
from pdserve.models.layers.fused_moe import FusedMoE, grouped_topk
from pdserve.models.layers.linear import ReplicatedLinear
from pdserve.models.layers.mla import MultiHeadLatentAttention
from pdserve.models.layers.rotary_embedding import RotaryEmbedding
from pdserve.models.llama import LlamaForCausalLM


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """Rows (x0, x1, x2, x3, ...) as (x0, x2, ..., x1, x3, ...): interleaved rope pairs in the
    rotate-half layout."""
    return torch.cat((rows[0::2], rows[1::2]))


class DeepseekMoE(nn.Module):
    """Routed experts (chosen by a float32 router, as HF keeps it) plus shared experts."""

    def __init__(
        self, hf_config: PretrainedConfig, params_dtype: torch.dtype, correction_bias: bool
    ) -> None:
        super().__init__()
        cfg = hf_config
        num_experts = cfg.n_routed_experts
        self.gate = ReplicatedLinear(cfg.hidden_size, num_experts, False, torch.float32)
        # V3's noaux_tc bias (its checkpoint name is gate.e_score_correction_bias).
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            if correction_bias
            else None
        )
        grouped = getattr(cfg, "topk_method", None) != "greedy"
        self.num_groups = (cfg.n_group or 1) if grouped else 1
        self.topk_group = cfg.topk_group or 1
        self.scoring = getattr(cfg, "scoring_func", "sigmoid" if correction_bias else "softmax")
        self.renormalize = bool(cfg.norm_topk_prob)
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.experts = FusedMoE(
            num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            renormalize=self.renormalize,
            params_dtype=params_dtype,
        )
        shared = cfg.moe_intermediate_size * (cfg.n_shared_experts or 0)
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, shared, cfg.hidden_act, False, params_dtype)
            if shared
            else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = grouped_topk(
            self.gate(hidden_states.float()),
            self.experts.top_k,
            self.num_groups,
            self.topk_group,
            self.scoring,
            self.renormalize,
            self.e_score_correction_bias,
        )
        weights = topk_weights * self.routed_scaling_factor
        out = self.experts.forward_topk(hidden_states, weights, topk_ids)
        if self.shared_experts is None:
            return out
        return out + self.shared_experts(hidden_states)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # Attention projections keep their own names: only the dense MLPs stack gate and up.
    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    expert_params = {
        "gate_proj": ("w13_weight", "w1"),
        "up_proj": ("w13_weight", "w3"),
        "down_proj": ("w2_weight", "w2"),
    }

    def _make_attention(self, rotary_emb: RotaryEmbedding) -> nn.Module:
        return MultiHeadLatentAttention(self.config, rotary_emb, self.params_dtype)

    # V3's routing: its scores steered by a learnt bias.
    correction_bias: ClassVar[bool] = False

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.config
        freq = getattr(cfg, "moe_layer_freq", 1)
        if (
            cfg.n_routed_experts
            and layer_idx >= cfg.first_k_dense_replace
            and layer_idx % freq == 0
        ):
            return DeepseekMoE(cfg, self.params_dtype, self.correction_bias)
        return GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, self.params_dtype
        )

    def _rope_interleaved(self) -> bool:
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._rope_rows_deinterleaved(weights))

    def _rope_rows_deinterleaved(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint with the rope rows of q (per head) and of the shared key de-interleaved
        (layers/mla.py: the rotate-half kernels then rotate DeepSeek's pairs)."""
        cfg = self.config
        nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        for name, tensor in weights:
            name = name.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")
            if not self._rope_interleaved():
                yield name, tensor
            elif name.endswith(("q_proj.weight", "q_b_proj.weight")):
                heads = tensor.view(cfg.num_attention_heads, nope + rope, -1)
                pe = heads[:, nope:].transpose(0, 1)  # [rope, heads, in]
                heads = torch.cat((heads[:, :nope], _deinterleave(pe).transpose(0, 1)), dim=1)
                yield name, heads.reshape(tensor.shape)
            elif name.endswith(("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")):
                latent = cfg.kv_lora_rank
                yield name, torch.cat((tensor[:latent], _deinterleave(tensor[latent:])))
            else:
                yield name, tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    correction_bias = True

    def _rope_interleaved(self) -> bool:
        return bool(getattr(self.config, "rope_interleave", True))
