"""DeepSeek-V2 and V3: the Llama decoder with multi-head latent attention (layers/mla.py), dense
MLPs in the first `first_k_dense_replace` layers and DeepSeek's MoE (deepseek_moe.py) after.

V3 differs in its routing (sigmoid scores, a correction bias) and may rotate its rope pairs
rotate-half style (rope_interleave false); its attention and cache are V2's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from pdserve.models.layers.decoder import GatedMLP
from pdserve.models.layers.mla import MultiHeadLatentAttention
from pdserve.models.layers.rotary_embedding import RotaryEmbedding
from pdserve.models.llama import LlamaForCausalLM


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """Rows (x0, x1, x2, x3, ...) as (x0, x2, ..., x1, x3, ...): interleaved rope pairs in the
    rotate-half layout."""
    return torch.cat((rows[0::2], rows[1::2]))


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

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.config
        if layer_idx >= cfg.first_k_dense_replace and layer_idx % cfg.moe_layer_freq == 0:
            raise NotImplementedError(
                f"{type(self).__name__}: layer {layer_idx} is a DeepSeek MoE layer, which "
                "pdserve does not build yet."
            )
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
    def _rope_interleaved(self) -> bool:
        return bool(getattr(self.config, "rope_interleave", True))
