"""Multi-head latent attention (DeepSeek-V2/V3): the KV cache keeps one latent per token.

Per token and layer the cache holds c = kv_a_layernorm(W_DKV x) (kv_lora_rank values) and the
rotated shared key part k_pe (qk_rope_head_dim values), instead of a key and a value per head.
Attention runs in the latent space with the up-projections absorbed, as vLLM's MLA backends do:
each head's q_nope is mapped into the latent (q_nope W_UK), so that a head's score against a
token is q_nope W_UK . c + q_pe . k_pe, and its output is (softmax . c) W_UV. That is MQA with
one KV head of dimension kv_lora_rank + qk_rope_head_dim whose value is the same entry: the
paged attention of every backend serves it over the cache view of `LatentAttention`. Prefill
runs the same way (no expanded keys), so both phases read the one cache layout.

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; the model de-interleaves the rope
rows of its projections at load, so the rotate-half kernels rotate the same pairs, and q . k
(both permuted alike) is unchanged.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.linear import PackedWeight, can_pack, linear, pack_weight
from pdserve.models.layers.attention import Attention
from pdserve.models.layers.layernorm import RMSNorm
from pdserve.models.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pdserve.models.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters, yarn_mscale

# DeepSeek's low-rank norms use RMSNorm's default epsilon, not the config's rms_norm_eps.
_LORA_NORM_EPS = 1e-6


class LatentAttention(Attention):
    """Attention whose cache entry (one per token, the same on every TP rank) is both key and
    value: the KV cache keeps one part per block instead of two (models/utils.py)."""

    latent: ClassVar[bool] = True


def mla_softmax_scale(hf_config: PretrainedConfig) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale squared where the rope stretches the context."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = get_rope_parameters(hf_config)
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        mscale = yarn_mscale(params["factor"], mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class MultiHeadLatentAttention(nn.Module):
    def __init__(
        self, hf_config: PretrainedConfig, rotary_emb: RotaryEmbedding, params_dtype: torch.dtype
    ) -> None:
        super().__init__()
        cfg = hf_config
        hidden, total_heads = cfg.hidden_size, cfg.num_attention_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias, params_dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LORA_NORM_EPS, params_dtype)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, total_heads * q_head_dim, False, params_dtype
            )
        else:
            self.q_proj = ColumnParallelLinear(
                hidden, total_heads * q_head_dim, False, params_dtype
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias, params_dtype
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS, params_dtype)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank,
            total_heads * (self.qk_nope_head_dim + self.v_head_dim),
            False,
            params_dtype,
        )
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias, params_dtype)
        self.num_heads = total_heads // self.o_proj.tp_size
        self.rotary_emb = rotary_emb
        latent_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.attn = LatentAttention(self.num_heads, latent_dim, 1, mla_softmax_scale(cfg))
        self._heads: list[tuple[tuple[torch.Tensor, PackedWeight | None], ...]] | None = None

    def _absorbed(self) -> list[tuple[tuple[torch.Tensor, PackedWeight | None], ...]]:
        """Per head of this rank: (W_UK^T [kv_lora_rank, qk_nope], W_UV [v, kv_lora_rank]), each
        with its packed form, from kv_b_proj's loaded weight (gathered at the first forward).
        One packed matmul per head, not a bmm: a bmm's sums change order with the batch."""
        if self._heads is None:
            w = self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)
            w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]
            self._heads = [
                tuple(
                    (m, pack_weight(m) if can_pack(m) else None) for m in (uk.t().contiguous(), uv)
                )
                for uk, uv in zip(w_uk, w_uv.contiguous(), strict=True)
            ]
        return self._heads

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        else:
            q = self.q_proj(hidden_states)
        q = q.view(num_tokens, self.num_heads, -1)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        heads = self._absorbed()
        q_latent = [linear(q_nope[:, h], w, None, p) for h, ((w, p), _) in enumerate(heads)]
        query = torch.cat((torch.stack(q_latent, dim=1), q_pe), dim=-1)
        entry = torch.cat((latent.unsqueeze(1), k_pe), dim=-1)
        out = self.attn(query, entry, entry, kv_cache, attn_metadata)[..., : self.kv_lora_rank]
        out = [linear(out[:, h], w, None, p) for h, (_, (w, p)) in enumerate(heads)]
        return self.o_proj(torch.cat(out, dim=-1))

    def forward_after_norm(
        self,
        norm: RMSNorm,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The interface of DecoderLayer's attention: normalize (adding the residual), attend."""
        x, residual = norm.with_residual(x, residual)
        return self(positions, x, kv_cache, attn_metadata), residual
