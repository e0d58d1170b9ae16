"""Attention over the paged KV cache: store this step's keys and values, then attend."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pdserve.kernels.attention import AttentionMetadata, paged_attention
from pdserve.kernels.kv_cache import UNIT_SCALE, KVScale, write_kv_cache


class Attention(nn.Module):
    """Per-rank attention of one layer; the caller has already split heads over TP ranks."""

    # A key and a value per token and KV head, each rank its own heads (mla.py's is a latent).
    latent: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        """`window`: each query sees its last `window` keys (sliding-window layers; 0: all);
        `softcap`: scores soft-capped to softcap * tanh(score / softcap) (0: not)."""
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.window = window
        self.softcap = softcap
        # An fp8 cache's (k_scale, v_scale): vLLM's default, 1.0 (checkpoint scales: not yet).
        self.kv_scale: KVScale = UNIT_SCALE

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query [T, num_heads, head_dim], key/value [T, num_kv_heads, head_dim] -> [T, num_heads,
        head_dim]. Rows past attn_metadata.num_actual_tokens (batch padding) come back zero."""
        write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping, self.kv_scale)
        out = paged_attention(
            query, kv_cache, attn_metadata, self.scale, self.window, self.softcap, self.kv_scale
        )
        if out.shape[0] == query.shape[0]:
            return out
        padded = query.new_zeros(query.shape)
        padded[: out.shape[0]] = out
        return padded
