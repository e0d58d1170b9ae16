"""Linear layers sharded over the tensor-parallel ranks (names and sharding as in vLLM).

Column-parallel layers split the output features, row-parallel layers the input features. Each
weight_loader takes the full checkpoint tensor and keeps this rank's shard, so models load HF
checkpoints unchanged at any TP size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pdserve.kernels.linear import PackedWeight, linear
from pdserve.kernels.quant_linear import BLOCK, GGUFRows, QuantWeight, block_bytes
from pdserve.models.utils import default_weight_loader, shard_sections, shard_tensor


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the TP size {denominator}.")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [output_size_per_partition, input_size_per_partition]."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.in_features, self.out_features = input_size, output_size
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self._load
        if bias:
            self.bias = nn.Parameter(
                torch.empty(output_size, dtype=params_dtype), requires_grad=False
            )
            self.bias.weight_loader = self._load
        else:
            self.register_parameter("bias", None)
        # Set after loading where the weight can be packed (kernels/linear.py), or from its GGUF
        # blocks (kernels/quant_linear.py).
        self.packed_weight: PackedWeight | QuantWeight | GGUFRows | None = None

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id: Any) -> None:
        """A checkpoint tensor into `param`; one kept in GGUF blocks (`gguf_qtype`) into rows of
        bytes, which replace the dense weight at its first shard. The rows are output features
        and a row's bytes are whole blocks of K, so the same sharding applies (a row-parallel
        rank's share of K is whole blocks, else loader/gguf.py dequantizes the projection)."""
        qtype = getattr(loaded, "gguf_qtype", None)
        if qtype is not None:
            if self.weight.dtype != torch.uint8:
                row_bytes = self.in_features // BLOCK * block_bytes(qtype)
                self.weight = nn.Parameter(
                    torch.empty(self.out_features, row_bytes, dtype=torch.uint8),
                    requires_grad=False,
                )
                self.weight.weight_loader = self._load
                self.weight.gguf_qtype = qtype
            param = self.weight
        self.weight_loader(param, loaded, *shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight (routers, small projections)."""


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; each rank's output is its slice (no gather)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(
            input_size, _divide(output_size, tp_size, "output_size"), bias, params_dtype
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, shard_tensor(loaded, 0, self.tp_rank, self.tp_size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate_up_proj)."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool, params_dtype: torch.dtype
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, params_dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        """One projection's checkpoint tensor (`shard_id`: which), or all of them as one
        (Mamba's in_proj, Qwen3.5's in_proj_qkv: None)."""
        if shard_id is None:
            shard = shard_sections(loaded, self.output_sizes, self.tp_rank, self.tp_size)
            default_weight_loader(param, shard)
            return
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        default_weight_loader(
            param.narrow(0, offset, size), shard_tensor(loaded, 0, self.tp_rank, self.tp_size)
        )


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, heads split over ranks.

    With more ranks than KV heads each KV head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        params_dtype: torch.dtype,
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.num_heads = _divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"TP size {tp_size} is not a multiple of "
                    f"num_key_value_heads={total_num_kv_heads}."
                )
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size = 0, q_size
            shard = shard_tensor(loaded, 0, self.tp_rank, self.tp_size)
        else:
            offset, size = (q_size if shard_id == "k" else q_size + kv_size), kv_size
            num_shards = self.tp_size // self.num_kv_head_replicas
            shard = shard_tensor(loaded, 0, self.tp_rank // self.num_kv_head_replicas, num_shards)
        default_weight_loader(param.narrow(0, offset, size), shard)


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial outputs are summed over ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        super().__init__(
            _divide(input_size, tp_size, "input_size"), output_size, bias, params_dtype
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is whole on every rank
            default_weight_loader(param, loaded)
            return
        default_weight_loader(param, shard_tensor(loaded, 1, self.tp_rank, self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias, self.packed_weight)
        out = tensor_model_parallel_all_reduce(linear(x, self.weight, None, self.packed_weight))
        # Added after the sum, so that the bias counts once rather than once per rank.
        return out if self.bias is None else out + self.bias
