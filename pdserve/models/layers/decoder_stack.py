"""Which stages the native decoder stack (kernels/cpu/decoder_stack.py) serves, and their weights
gathered for it, by what their layers declare: `DecoderLayer`s of a `SelfAttention` without q/k
norms and a `GatedMLP` (Llama, Qwen2, Mistral), projections bf16-packed or in GGUF blocks on one
TP rank, one RMSNorm epsilon throughout. Q/k norms (Qwen3), MoE MLPs and TP > 1 run their layers one by one."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels.cpu.decoder_stack import DecoderStack, LayerWeights
from pdserve.models.layers.activation import SiluAndMul
from pdserve.models.layers.decoder import DecoderLayer, GatedMLP, SelfAttention


def _stack_weights(layer: nn.Module) -> LayerWeights | None:
    """A layer's weights for the native decoder stack; None where it is not an attention without q/k norms and a gated MLP with
    bf16-packed projections on one TP rank."""
    if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, GatedMLP):
        return None
    if layer.residual_multiplier != 1.0 or not isinstance(layer.mlp.act_fn, SiluAndMul):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(attn, SelfAttention) or attn.q_norm is not None or attn.o_proj.tp_size > 1:
        return None
    if attn.attn.window or attn.attn.softcap:  # the stack attends to every key, uncapped
        return None
    if attn.rotary_emb.rotary_dim != attn.head_dim:  # and turns whole heads
        return None
    packed = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    if any(p.packed_weight is None for p in packed):
        return None
    return LayerWeights(
        layer.input_layernorm.weight,
        attn.qkv_proj.packed_weight,
        attn.qkv_proj.bias,
        attn.o_proj.packed_weight,
        attn.o_proj.bias,
        layer.post_attention_layernorm.weight,
        mlp.gate_up_proj.packed_weight,
        mlp.gate_up_proj.bias,
        mlp.down_proj.packed_weight,
        mlp.down_proj.bias,
    )


def build_decoder_stack(
    layers: list[nn.Module], cos_sin_cache: torch.Tensor
) -> DecoderStack | None:
    """The stack of a stage's `layers`, or None where one of them does not qualify."""
    weights = [_stack_weights(layer) for layer in layers]
    if any(w is None for w in weights) or not DecoderStack.available(weights):
        return None
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if len({n.variance_epsilon for n in norms}) != 1:
        return None
    attn = layers[0].self_attn
    return DecoderStack(
        weights,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        norms[0].variance_epsilon,
        attn.attn.scale,
        cos_sin_cache,
        lambda: [layer.self_attn.attn.kv_scale for layer in layers],
    )
