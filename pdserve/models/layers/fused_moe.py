"""Mixture-of-experts layer: softmax router, top-k experts per token (torch reference).

Expert weights are stacked per projection, w13 = [gate | up] of shape
[num_experts, 2 * intermediate, hidden] and w2 of shape [num_experts, hidden, intermediate],
with the intermediate dimension split over TP ranks like a column- then row-parallel MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pdserve.kernels.linear import PackedWeight, linear
from pdserve.models.layers.activation import SiluAndMul
from pdserve.models.utils import default_weight_loader, shard_tensor


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k]) of each token's top-k experts."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    scoring: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing (vLLM's grouped_topk): (weights [T, top_k] float32, expert ids).

    The experts' scores (softmax, or sigmoid) choose; with `num_groups` > 1 only the experts of
    the `topk_group` best groups may be chosen, a group scored by its best expert, or, with a
    `correction_bias` (DeepSeek-V3's noaux_tc), by the sum of its best two biased scores. The bias
    steers the choice only: the weights are the unbiased scores."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if num_groups > 1:
        grouped = choice.view(choice.shape[0], num_groups, -1)
        if correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        kept = kept.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
        choice = choice.masked_fill(~kept, 0.0 if correction_bias is None else float("-inf"))
    topk_ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights, topk_ids


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        params_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"moe intermediate size {intermediate_size} is not divisible by the TP size "
                f"{self.tp_size}."
            )
        self.intermediate_size_per_partition = intermediate_size // self.tp_size
        shard = self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * shard, hidden_size, dtype=params_dtype),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, shard, dtype=params_dtype), requires_grad=False
        )
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # Each expert's (w13, w2), set after loading where they can be packed (kernels/linear.py):
        # an expert's share of a batch varies with the batch, and only the packed kernel sums
        # each row in one order at any number of rows.
        self.packed_experts: list[tuple[PackedWeight, PackedWeight]] | None = None
        self.act_fn = SiluAndMul()

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str, expert_id: int
    ) -> None:
        """Place one expert's gate ("w1"), down ("w2") or up ("w3") projection."""
        if shard_id == "w2":
            default_weight_loader(
                param[expert_id], shard_tensor(loaded, 1, self.tp_rank, self.tp_size)
            )
            return
        shard = self.intermediate_size_per_partition
        offset = 0 if shard_id == "w1" else shard
        default_weight_loader(
            param[expert_id].narrow(0, offset, shard),
            shard_tensor(loaded, 0, self.tp_rank, self.tp_size),
        )

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, hidden], router_logits [T, num_experts] -> [T, hidden]."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.forward_topk(hidden_states, topk_weights, topk_ids)

    def forward_topk(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """Each token through its chosen experts (ids [T, top_k]), summed with their weights."""
        topk_weights = topk_weights.to(hidden_states.dtype)
        out = torch.zeros_like(hidden_states)
        # Only the experts some token chose, in expert order (HF's order, so sums match).
        for expert_id in topk_ids.unique().tolist():
            token_idx, k_idx = torch.where(topk_ids == expert_id)
            w13, w2 = self.w13_weight[expert_id], self.w2_weight[expert_id]
            packed13, packed2 = (
                self.packed_experts[expert_id] if self.packed_experts else (None, None)
            )
            gate_up = linear(hidden_states[token_idx], w13, None, packed13)
            expert_out = linear(self.act_fn(gate_up), w2, None, packed2)
            out.index_add_(0, token_idx, expert_out * topk_weights[token_idx, k_idx, None])
        return tensor_model_parallel_all_reduce(out)
