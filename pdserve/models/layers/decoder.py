"""A pre-norm decoder layer's parts as model families declare them: `GatedMLP`, `SelfAttention`
and `DecoderLayer`, which holds an attention and an MLP between two RMSNorms.

The CPU fast paths are chosen here, by what the parts declare, not by the families: the input
norm and q/k/v in one native call where the projection is bf16-packed; rotary, the cache write
and attention in one call where the attention has no q/k norms; the post-attention norm and the
MLP in one call for a `GatedMLP`; and a stage's layers as one call where each fits
(`decoder_stack.py`). Each falls back to the separate steps where it does not apply, with the
same bits. A family built of these parts (Llama, Mistral, Qwen2, Qwen3, the MoE models' attention
and shared experts) gets them by declaration.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from pdserve.kernels.attention import AttentionMetadata, rope_attention_cpu
from pdserve.kernels.cpu.norm_linear import norm_linear, norm_mlp
from pdserve.models.layers.activation import GATED_ACTIVATIONS, SiluAndMul
from pdserve.models.layers.attention import Attention
from pdserve.models.layers.layernorm import RMSNorm
from pdserve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pdserve.models.layers.rotary_embedding import RotaryEmbedding


class GatedMLP(nn.Module):
    """gate and up in one projection, a gated activation, down (Llama's MLP)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias, params_dtype
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, params_dtype)
        self.act_fn = GATED_ACTIVATIONS.get(hidden_act)()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def forward_after_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x, residual)[0]), residual + x): one native call where it applies."""
        down = self.down_proj
        reduce = down.tp_size > 1  # each rank holds a partial sum; the bias counts once
        fused = None
        if isinstance(self.act_fn, SiluAndMul):  # the native call computes silu
            fused = norm_mlp(
                x,
                residual,
                norm.weight,
                norm.variance_epsilon,
                self.gate_up_proj.packed_weight,
                self.gate_up_proj.bias,
                down.packed_weight,
                None if reduce else down.bias,
            )
        if fused is None:
            x, residual = norm(x, residual)
            return self(x), residual
        out, residual = fused
        if reduce:
            out = tensor_model_parallel_all_reduce(out)
            out = out if down.bias is None else out + down.bias
        return out, residual


def head_dim_of(hf_config: PretrainedConfig) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


class SelfAttention(nn.Module):
    """q/k/v in one projection (biases as the family says), optional per-head q/k norms,
    rotary, paged attention, o (Llama's; Qwen2 and Qwen3 declare their switches)."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        params_dtype: torch.dtype,
        scale: float | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        """`scale`: of q.k, head_dim^-0.5 unless the family says otherwise; `window` and
        `softcap`: Attention's."""
        super().__init__()
        hidden_size = hf_config.hidden_size
        total_num_heads = hf_config.num_attention_heads
        total_num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_num_heads
        self.head_dim = head_dim_of(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, total_num_heads, total_num_kv_heads, qkv_bias, params_dtype
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_num_heads * self.head_dim, hidden_size, o_bias, params_dtype
        )
        eps = hf_config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, params_dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, params_dtype) if qk_norm else None
        self.rotary_emb = rotary_emb
        scale = self.head_dim**-0.5 if scale is None else scale
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, scale, window, softcap
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        return self._attend(positions, self.qkv_proj(hidden_states), kv_cache, attn_metadata)

    def forward_after_norm(
        self,
        norm: RMSNorm,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(positions, norm(x, residual)[0], ...), the residual stream): the norm and q/k/v
        in one native call where it applies."""
        qkv = self.qkv_proj
        fused = norm_linear(
            x, residual, norm.weight, norm.variance_epsilon, qkv.packed_weight, qkv.bias
        )
        if fused is not None:
            projected, residual = fused
            return self._attend(positions, projected, kv_cache, attn_metadata), residual
        x, residual = norm.with_residual(x, residual)
        return self(positions, x, kv_cache, attn_metadata), residual

    def _attend(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.q_norm is None and self.rotary_emb.rotary_dim == self.head_dim:
            # Rotary, the cache write and attention in one native call where it applies.
            out = rope_attention_cpu(
                qkv,
                positions,
                self.rotary_emb.cos_sin_cache,
                kv_cache,
                attn_metadata,
                self.num_heads,
                self.head_dim,
                self.attn.scale,
                self.attn.window,
                self.attn.softcap,
                self.attn.kv_scale,
            )
            if out is not None:
                return self.o_proj(out)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    """Input norm, attention, post-attention norm, MLP; the residual stream left unsummed.

    Granite scales what attention and the MLP add to the residual stream by its config's
    residual_multiplier (HF: residual + out * multiplier)."""

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        hf_config: PretrainedConfig,
        params_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, params_dtype)
        self.residual_multiplier = float(getattr(hf_config, "residual_multiplier", 1.0))

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream it adds to), left unsummed (vLLM's layout):
        the next norm adds them, so each residual add is fused into the norm that follows it."""
        hidden_states, residual = self.self_attn.forward_after_norm(
            self.input_layernorm, positions, hidden_states, residual, kv_cache, attn_metadata
        )
        hidden_states = self._scaled(hidden_states)
        if isinstance(self.mlp, GatedMLP):
            hidden_states, residual = self.mlp.forward_after_norm(
                self.post_attention_layernorm, hidden_states, residual
            )
        else:
            hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
        return self._scaled(hidden_states), residual

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier
