"""Rotary position embedding, as HF computes it (rotate_half layout).

cos and sin are computed once per model for every position, with HF's float32 ops on the
model's device, and gathered per step (see pdserve.kernels.rotary): the same values HF
computes per step, without evaluating them again in every layer of every step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.kernels.rotary import build_cos_sin_cache, rotary_embedding

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def get_rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The rope parameters of a config: transformers 5's `rope_parameters`, else the older
    `rope_theta` + `rope_scaling` attributes (configs read from a raw config.json)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    # On the CPU whatever the model's device, so that every device gets HF's exact values.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the middle interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, the factor on cos and sin) of YaRN: high frequencies kept, low
    ones interpolated, a linear ramp between (HF's _compute_yarn_parameters)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    kept = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """One per model: every attention layer shares its cos/sin table. With a partial rotary
    factor (Qwen3.5) only a head's first `rotary_dim` values turn, the rest pass (HF's layout)."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_position: int,
        dtype: torch.dtype,
        attention_factor: float = 1.0,
    ) -> None:
        super().__init__()
        table = build_cos_sin_cache(inv_freq, max_position, dtype, attention_factor)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self.rotary_dim = 2 * inv_freq.shape[0]

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, num_heads, head_dim] and key [T, num_kv_heads, head_dim]."""
        dim = self.rotary_dim
        if dim == query.shape[-1]:
            return rotary_embedding(positions, query, key, self.cos_sin_cache)
        q, k = (x[..., :dim].contiguous() for x in (query, key))
        q, k = rotary_embedding(positions, q, k, self.cos_sin_cache)
        return torch.cat((q, query[..., dim:]), dim=-1), torch.cat((k, key[..., dim:]), dim=-1)


def get_rope(
    head_dim: int, rope_parameters: dict[str, Any], max_position: int, dtype: torch.dtype
) -> RotaryEmbedding:
    """The rotary embedding of positions [0, max_position), its table in `dtype`."""
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(_SUPPORTED_ROPE_TYPES)}."
        )
    # HF's rule: the first int(head_dim * factor) values of a head turn.
    head_dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))
    base = rope_parameters["rope_theta"]
    if rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(base, head_dim, rope_parameters, max_position)
        return RotaryEmbedding(inv_freq, max_position, dtype, attention_factor)
    inv_freq = _default_inv_freq(base, head_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / rope_parameters["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
    return RotaryEmbedding(inv_freq, max_position, dtype)
