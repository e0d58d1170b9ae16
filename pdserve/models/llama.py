"""The Llama decoder, and the models that are Llama with small switches.

Mistral is Llama; Qwen2 adds a bias to q, k and v (not o); Qwen3 normalizes q and k per head
before the rotary embedding. The MoE models (qwen2_moe, mixtral) subclass LlamaForCausalLM and
swap the MLP. Under pipeline parallelism each stage builds its own layers; the first stage
also embeds, the last also normalizes and computes the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pdserve.distributed.parallel_state import (
    IntermediateTensors,
    is_first_stage,
    is_last_stage,
)
from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.cpu.decoder_stack import DecoderStack
from pdserve.models.layers.decoder import DecoderLayer, GatedMLP, SelfAttention, head_dim_of
from pdserve.models.layers.decoder_stack import build_decoder_stack
from pdserve.models.layers.layernorm import RMSNorm
from pdserve.models.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pdserve.models.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.models.utils import (
    PPMissingLayer,
    empty_intermediate_tensors,
    load_checkpoint_weights,
    make_layers,
    warn_sliding_window,
)


class LlamaModel(nn.Module):
    def __init__(
        self,
        hf_config: PretrainedConfig,
        params_dtype: torch.dtype,
        make_layer: Callable[[int, RotaryEmbedding], nn.Module],
        tie_word_embeddings: bool,
        embedding_multiplier: float,
    ) -> None:
        super().__init__()
        self.is_first_stage, self.is_last_stage = is_first_stage(), is_last_stage()
        # A tied head is the embedding, so the last stage holds it too.
        if self.is_first_stage or (tie_word_embeddings and self.is_last_stage):
            self.embed_tokens = VocabParallelEmbedding(
                hf_config.vocab_size, hf_config.hidden_size, params_dtype
            )
        else:
            self.embed_tokens = PPMissingLayer()
        # One table for all layers, as HF's model-level rotary_emb.
        self.rotary_emb = get_rope(
            head_dim_of(hf_config),
            get_rope_parameters(hf_config),
            getattr(hf_config, "max_position_embeddings", None) or 2048,
            params_dtype,
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            hf_config.num_hidden_layers,
            lambda i: make_layer(i, self.rotary_emb),
        )
        self.norm = (
            RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, params_dtype)
            if self.is_last_stage
            else PPMissingLayer()
        )
        self.embedding_multiplier = embedding_multiplier
        self._stack: DecoderStack | None = None
        self._stack_checked = False

    def _decoder_stack(self) -> DecoderStack | None:
        """This stage's layers as one native call, gathered once at the first forward (after the
        weights were packed); None where they do not qualify (layers/decoder_stack.py)."""
        if not self._stack_checked:
            self._stack_checked = True
            layers = list(islice(self.layers, self.start_layer, self.end_layer))
            self._stack = build_decoder_stack(layers, self.rotary_emb.cos_sin_cache)
        return self._stack

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The final hidden states on the last stage; the residual stream, left unsummed, on
        the others. `kv_caches` holds this stage's layers only."""
        if self.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids), None
            if self.embedding_multiplier != 1.0:
                hidden_states = hidden_states * self.embedding_multiplier
        else:
            assert intermediate_tensors is not None, "a later stage continues the previous one"
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        stack = self._decoder_stack()
        fused = stack and stack.forward(
            hidden_states, residual, positions, kv_caches, attn_metadata
        )
        if fused:
            hidden_states, residual = fused
        else:
            layers = islice(self.layers, self.start_layer, self.end_layer)
            for layer, kv_cache in zip(layers, kv_caches, strict=True):
                hidden_states, residual = layer(
                    positions, hidden_states, residual, kv_cache, attn_metadata
                )
        assert residual is not None, "a stage has at least one layer"
        if not self.is_last_stage:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        return self.norm(hidden_states, residual)[0]


class LlamaForCausalLM(nn.Module):
    qk_norm: ClassVar[bool] = False
    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    # Checkpoint expert projection name -> (FusedMoE parameter, shard id); MoE models set it.
    expert_params: ClassVar[dict[str, tuple[str, str]]] = {}
    # Whether the family's layers attend through the config's sliding window (else: a warning).
    honours_sliding_window: ClassVar[bool] = False

    def __init__(self, hf_config: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        self.params_dtype = dtype
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.honours_sliding_window:
            warn_sliding_window(hf_config)
        self.model = LlamaModel(
            hf_config,
            dtype,
            self._make_layer,
            self.tie_word_embeddings,
            self._embedding_multiplier(),
        )
        if not is_last_stage():
            self.lm_head = PPMissingLayer()
        elif self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)

    def _make_layer(self, layer_idx: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(
            self._make_attention(rotary_emb),
            self._make_mlp(layer_idx),
            self.config,
            self.params_dtype,
        )

    def _embedding_multiplier(self) -> float:
        """What the embeddings are scaled by (Granite and Gemma scale them)."""
        return 1.0

    def _attention_biases(self) -> tuple[bool, bool]:
        """(q/k/v bias, o bias)."""
        bias = bool(getattr(self.config, "attention_bias", False))
        return bias, bias

    def _make_attention(self, rotary_emb: RotaryEmbedding) -> nn.Module:
        qkv_bias, o_bias = self._attention_biases()
        return SelfAttention(
            self.config, rotary_emb, qkv_bias, o_bias, self.qk_norm, self.params_dtype
        )

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.config
        return GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.hidden_act,
            bool(getattr(cfg, "mlp_bias", False)),
            self.params_dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors)

    def make_empty_intermediate_tensors(
        self, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """Buffers for what the previous stage sends this one."""
        return empty_intermediate_tensors(
            ("hidden_states", "residual"), num_tokens, self.config.hidden_size, dtype, device
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint_weights(
            self,
            weights,
            stacked_params=self.stacked_params,
            expert_params=self.expert_params,
            # Tied checkpoints may still carry the head; the embedding is the head here.
            ignored=["lm_head.weight"] if self.tie_word_embeddings else [],
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    def _attention_biases(self) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
