"""Token embedding and LM head with the vocabulary split over tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pdserve.kernels.linear import PackedWeight, linear
from pdserve.kernels.quant_linear import GGUFRows, QuantWeight
from pdserve.models.utils import default_weight_loader
from pdserve.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r * per_partition, (r + 1) * per_partition) of the vocabulary.

    The last rank's rows past the vocabulary are zero padding, so every rank's shard has the
    same shape.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        per_partition = cdiv(num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * per_partition
        self.vocab_end = min(self.vocab_start + per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(per_partition, embedding_dim, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        # Set after loading where the weight can be packed for the LM head (kernels/linear.py),
        # from its GGUF blocks where the checkpoint kept them (kernels/quant_linear.py).
        self.packed_weight: PackedWeight | QuantWeight | GGUFRows | None = None
        self.gguf_blocks: tuple[torch.Tensor, int] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"embedding of shape {tuple(loaded.shape)} does not have the vocabulary size "
                f"{self.num_embeddings} rows"
            )
        rows = self.vocab_end - self.vocab_start
        default_weight_loader(param[:rows], loaded[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()
        blocks = getattr(loaded, "gguf_blocks", None)
        if blocks is not None:
            # This rank's rows of blocks, padded as the weight is: zero bytes are zero weights in
            # every kept format (scales and minimums 0).
            raw, qtype = blocks
            shard = raw[self.vocab_start : self.vocab_end]
            padding = shard.new_zeros(param.shape[0] - rows, shard.shape[1])
            blocks = (torch.cat([shard, padding]) if len(padding) else shard, qtype)
        self.gguf_blocks = blocks

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of hidden states [N, embedding_dim], as an LM head, in float32: the
        kernel's float32 sums, never rounded to bf16 (bf16 logits tie where float32 ones do not,
        and argmax would break the tie by token id)."""
        logits = linear(hidden_states, self.weight, None, self.packed_weight, torch.float32)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.num_embeddings]
        return logits


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection of an untied model: only `compute_logits` uses it."""
