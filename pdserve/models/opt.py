"""OPT: learned positions (offset 2), LayerNorm before or after each block, ReLU MLP, and an
optional projection between the embedding width and the hidden width (opt-350m). Under pipeline
parallelism the first stage embeds (and projects in), the last normalizes (and projects out)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pdserve.distributed.parallel_state import IntermediateTensors, is_first_stage, is_last_stage
from pdserve.kernels.attention import AttentionMetadata
from pdserve.models.layers.activation import get_act_fn
from pdserve.models.layers.attention import Attention
from pdserve.models.layers.layernorm import LayerNorm
from pdserve.models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pdserve.models.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.models.utils import (
    PPMissingLayer,
    empty_intermediate_tensors,
    load_checkpoint_weights,
    make_layers,
)

# OPT's checkpoints index positions from 2 (rows 0 and 1 were reserved by fairseq).
_POSITION_OFFSET = 2


class OPTLearnedPositionalEmbedding(nn.Module):
    def __init__(self, num_positions: int, embedding_dim: int, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_positions + _POSITION_OFFSET, embedding_dim, dtype=params_dtype),
            requires_grad=False,
        )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + _POSITION_OFFSET, self.weight)


class OPTAttention(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, params_dtype: torch.dtype) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        total_num_heads = hf_config.num_attention_heads
        self.head_dim = hidden_size // total_num_heads
        self.scaling = self.head_dim**-0.5
        bias = hf_config.enable_bias
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, total_num_heads, total_num_heads, bias, params_dtype
        )
        self.num_heads = self.qkv_proj.num_heads
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias, params_dtype)
        # HF scales q before attention; so do we, to match its numerics.
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, scale=1.0)

    def forward(
        self, hidden_states: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        shape = (self.num_heads, self.head_dim)
        q = (q * self.scaling).unflatten(-1, shape)
        out = self.attn(q, k.unflatten(-1, shape), v.unflatten(-1, shape), kv_cache, attn_metadata)
        return self.out_proj(out.flatten(1))


class OPTDecoderLayer(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, params_dtype: torch.dtype) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        affine = hf_config.layer_norm_elementwise_affine
        self.do_layer_norm_before = hf_config.do_layer_norm_before
        self.self_attn = OPTAttention(hf_config, params_dtype)
        self.self_attn_layer_norm = LayerNorm(
            hidden_size, elementwise_affine=affine, dtype=params_dtype
        )
        bias = hf_config.enable_bias
        self.fc1 = ColumnParallelLinear(hidden_size, hf_config.ffn_dim, bias, params_dtype)
        self.activation_fn = get_act_fn(hf_config.activation_function)
        self.fc2 = RowParallelLinear(hf_config.ffn_dim, hidden_size, bias, params_dtype)
        self.final_layer_norm = LayerNorm(
            hidden_size, elementwise_affine=affine, dtype=params_dtype
        )

    def forward(
        self, hidden_states: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, kv_cache, attn_metadata)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.activation_fn(self.fc1(hidden_states)))
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    """Modules another pipeline stage holds are `PPMissingLayer`s; those the model lacks, None."""

    def __init__(
        self, hf_config: PretrainedConfig, params_dtype: torch.dtype, tie_word_embeddings: bool
    ) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        proj_dim = hf_config.word_embed_proj_dim
        first, last = is_first_stage(), is_last_stage()
        self.is_first_stage, self.is_last_stage = first, last
        # A tied head is the embedding, so the last stage holds it too.
        self.embed_tokens = (
            VocabParallelEmbedding(hf_config.vocab_size, proj_dim, params_dtype)
            if first or (tie_word_embeddings and last)
            else PPMissingLayer()
        )
        self.embed_positions = (
            OPTLearnedPositionalEmbedding(
                hf_config.max_position_embeddings, hidden_size, params_dtype
            )
            if first
            else PPMissingLayer()
        )
        self.project_in = self.project_out = None
        if proj_dim != hidden_size:
            self.project_in = (
                ReplicatedLinear(proj_dim, hidden_size, False, params_dtype)
                if first
                else PPMissingLayer()
            )
            self.project_out = (
                ReplicatedLinear(hidden_size, proj_dim, False, params_dtype)
                if last
                else PPMissingLayer()
            )
        self.final_layer_norm = None
        if hf_config.do_layer_norm_before and not getattr(
            hf_config, "_remove_final_layer_norm", False
        ):
            self.final_layer_norm = (
                LayerNorm(
                    hidden_size,
                    elementwise_affine=hf_config.layer_norm_elementwise_affine,
                    dtype=params_dtype,
                )
                if last
                else PPMissingLayer()
            )
        self.start_layer, self.end_layer, self.layers = make_layers(
            hf_config.num_hidden_layers, lambda i: OPTDecoderLayer(hf_config, params_dtype)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if self.is_first_stage:
            hidden_states = self.embed_tokens(input_ids)
            if self.project_in is not None:
                hidden_states = self.project_in(hidden_states)
            hidden_states = hidden_states + self.embed_positions(positions)
        else:
            assert intermediate_tensors is not None, "a later stage continues the previous one"
            hidden_states = intermediate_tensors["hidden_states"]
        layers = islice(self.layers, self.start_layer, self.end_layer)
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, kv_cache, attn_metadata)
        if not self.is_last_stage:
            return IntermediateTensors({"hidden_states": hidden_states})
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(
        self, hf_config: PretrainedConfig, params_dtype: torch.dtype, tie_word_embeddings: bool
    ) -> None:
        super().__init__()
        self.decoder = OPTDecoder(hf_config, params_dtype, tie_word_embeddings)


class OPTForCausalLM(nn.Module):
    stacked_params: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    )

    def __init__(self, hf_config: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.model = OPTModel(hf_config, dtype, self.tie_word_embeddings)
        if not is_last_stage():
            self.lm_head = PPMissingLayer()
        elif self.tie_word_embeddings:
            self.lm_head = self.model.decoder.embed_tokens
        else:
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size, hf_config.word_embed_proj_dim, dtype
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Hidden states [T, hidden_size] on the last stage (project_out, if any, belongs to
        compute_logits); the stage's activations on the others."""
        return self.model.decoder(
            input_ids, positions, kv_caches, attn_metadata, intermediate_tensors
        )

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """Buffers for what the previous stage sends this one."""
        return empty_intermediate_tensors(
            ("hidden_states",), num_tokens, self.config.hidden_size, dtype, device
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        project_out = self.model.decoder.project_out
        if project_out is not None:
            hidden_states = project_out(hidden_states)
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint_weights(
            self,
            # facebook/opt-* checkpoints name the decoder without the "model." prefix.
            (
                (n if n.startswith("model.") or n == "lm_head.weight" else f"model.{n}", t)
                for n, t in weights
            ),
            stacked_params=self.stacked_params,
            ignored=["lm_head.weight"] if self.tie_word_embeddings else [],
        )
