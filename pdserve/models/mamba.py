"""Mamba (attention-free, Model Runner V1): each layer keeps a fixed-size state per request
instead of paged keys and values.

A layer's state is its convolution's last conv_kernel - 1 inputs and its SSM state
[intermediate, state_size], in the request's slot (models/state_cache.py): the forward gets
each layer's (conv, ssm) views in `caches.state`, `attn_metadata.state_slots` each request's
slot (its one block). A request whose context is empty (a new prompt, or one preempted and
recomputed) starts from zeros; a later chunk of a prompt, or a decode step, continues its
slot's state. The scan runs token by token in float32 as HF's torch path does, so chunked
prefill and decode give the bits of one pass over the whole sequence."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pdserve.distributed.parallel_state import get_tensor_model_parallel_world_size
from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.cpu import recurrent as recurrent_cpu
from pdserve.kernels.linear import linear
from pdserve.models.layers.layernorm import RMSNorm
from pdserve.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pdserve.models.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.models.state_cache import StateModelCaches, StepPlan
from pdserve.models.utils import load_checkpoint_weights, sharded_loader


class MambaMixer(nn.Module):
    """HF's MambaMixer, its channels (inner) split over TP ranks: in_proj and dt_proj by output,
    x_proj and out_proj by input (their partial sums added over ranks), the convolution, A and
    D by channel; each rank keeps its channels' states."""

    def __init__(self, hf_config: PretrainedConfig, params_dtype: torch.dtype) -> None:
        super().__init__()
        cfg = hf_config
        inner, self.state_size = cfg.intermediate_size, cfg.state_size
        self.time_step_rank = int(cfg.time_step_rank)
        self.conv_kernel = cfg.conv_kernel
        self.in_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inner, inner], cfg.use_bias, params_dtype
        )
        local = inner // get_tensor_model_parallel_world_size()
        # Depthwise: one filter of conv_kernel taps per channel (HF's Conv1d weight layout).
        self.conv1d = nn.Module()
        self.conv1d.weight = self._channels(local, 1, cfg.conv_kernel, dtype=params_dtype)
        self.conv1d.bias = self._channels(local, dtype=params_dtype) if cfg.use_conv_bias else None
        self.x_proj = RowParallelLinear(
            inner, self.time_step_rank + 2 * cfg.state_size, False, params_dtype
        )
        self.dt_proj = ColumnParallelLinear(self.time_step_rank, inner, True, params_dtype)
        self.A_log = self._channels(local, cfg.state_size, dtype=params_dtype)
        self.D = self._channels(local, dtype=params_dtype)
        self.out_proj = RowParallelLinear(inner, cfg.hidden_size, cfg.use_bias, params_dtype)

    @staticmethod
    def _channels(local: int, *shape: int, dtype: torch.dtype) -> nn.Parameter:
        """A parameter of this rank's `local` channels (its rows of the checkpoint's)."""
        param = nn.Parameter(torch.empty(local, *shape, dtype=dtype), requires_grad=False)
        return sharded_loader(param, [local * get_tensor_model_parallel_world_size()])

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, SSM state) of one request."""
        inner = self.D.shape[0]
        return (inner, self.conv_kernel - 1), (inner, self.state_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor],
        plan: StepPlan,
    ) -> torch.Tensor:
        out_features = self.out_proj.weight.shape[0]
        return plan.run(hidden_states, out_features, state, self._request, self._step)

    def _selection(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dt [N, inner] float32, B, C [N, state]) of convolved tokens u [N, inner]: row by
        row the same bits however many rows (the packed linear, not a float32 matmul)."""
        time_step, B, C = self.x_proj(u).split(
            [self.time_step_rank, self.state_size, self.state_size], dim=-1
        )
        dt = linear(time_step, self.dt_proj.weight, None, self.dt_proj.packed_weight)
        return F.softplus(dt + self.dt_proj.bias.float()), B, C

    def _convolve(self, padded: torch.Tensor) -> torch.Tensor:
        """The causal convolution of [N, inner, kernel - 1 + T] inputs: [N, inner, T]."""
        weight = self.conv1d.weight
        return F.silu(F.conv1d(padded, weight, self.conv1d.bias, groups=weight.shape[0]))

    def _scan(
        self,
        u: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """One token of each of R requests, convolved u [R, inner], on the SSM states at
        `slots` (updated in place): the readout [R, inner] in u's dtype. One native pass where
        it applies (a prompt's tokens and decode steps alike: the same bits)."""
        dt, B, C = self._selection(u)
        A = -torch.exp(self.A_log.float())
        y = recurrent_cpu.mamba_step(dt, A, B, C, u, states, slots)
        if y is not None:
            return y.to(u.dtype)
        dA = torch.exp(A[None] * dt[:, :, None])  # [R, inner, state]
        state = dA * states[slots] + dt[:, :, None] * B.float()[:, None, :] * u.float()[:, :, None]
        states[slots] = state
        return (state.to(u.dtype) * C[:, None, :]).sum(dim=-1)

    def _step(
        self, x: torch.Tensor, conv_state: torch.Tensor, states: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token [R, hidden] of each of R requests from their conv states [R, ...] and SSM
        states (`states` at `slots`, updated in place): (the output, the new conv states),
        HF's recurrent form."""
        dtype = x.dtype
        u, gate = self.in_proj(x).chunk(2, dim=-1)  # [R, inner] each
        padded = torch.cat((conv_state.to(dtype), u[:, :, None]), dim=2)
        u = self._convolve(padded)[:, :, -1]
        y = self._scan(u, states, slots) + u * self.D
        y = y * F.silu(gate)
        return self.out_proj(y.to(dtype)), padded[:, :, 1:]

    def _request(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> torch.Tensor:
        """One request's tokens [T, hidden] from its states, which it leaves updated: each
        token scanned as a decode step is (the same bits)."""
        dtype = x.dtype
        u, gate = self.in_proj(x).t().chunk(2, dim=0)  # [inner, T] each
        # The causal convolution over the previous kernel - 1 inputs and these.
        padded = torch.cat((conv_state.to(dtype), u), dim=1)
        conv_state.copy_(padded[:, -conv_state.shape[1] :])
        u = self._convolve(padded[None])[0].t()  # [T, inner]
        slot = torch.zeros(1, dtype=torch.int64)
        ys = [self._scan(u[t : t + 1], ssm_state[None], slot) for t in range(u.shape[0])]
        y = torch.cat(ys) + u * self.D
        y = y * F.silu(gate.t())
        return self.out_proj(y.to(dtype))


class MambaBlock(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon, params_dtype)
        self.mixer = MambaMixer(hf_config, params_dtype)


class MambaForCausalLM(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = hf_config
        cfg = hf_config
        self.backbone = nn.Module()
        self.backbone.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.backbone.layers = nn.ModuleList(
            MambaBlock(cfg, dtype) for _ in range(cfg.num_hidden_layers)
        )
        self.backbone.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = (
            self.backbone.embeddings
            if self.tie_word_embeddings
            else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)
        )
        # HF keeps the residual stream in float32 where the config asks.
        self.residual_dtype = torch.float32 if cfg.residual_in_fp32 else dtype

    def state_shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per layer: the shapes of one request's (conv state, SSM state)."""
        return [layer.mixer.state_shapes() for layer in self.backbone.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: StateModelCaches,
        attn_metadata: AttentionMetadata,
        intermediate_tensors: None = None,
    ) -> torch.Tensor:
        n = attn_metadata.num_actual_tokens
        hidden = self.backbone.embeddings(input_ids[:n]).to(self.residual_dtype)
        dtype = self.backbone.norm_f.weight.dtype
        plan = StepPlan.of(attn_metadata, hidden.device)
        for layer, state in zip(self.backbone.layers, caches.state, strict=True):
            mixed = layer.mixer(layer.norm(hidden.to(dtype)), state, plan)
            hidden = hidden + mixed
        out = self.backbone.norm_f(hidden.to(dtype))
        if out.shape[0] == input_ids.shape[0]:
            return out
        padded = out.new_zeros(input_ids.shape[0], out.shape[1])  # batch padding rows
        padded[:n] = out
        return padded

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint_weights(
            self, weights, ignored=["lm_head.weight"] if self.tie_word_embeddings else []
        )
