"""Gated DeltaNet, Qwen3.5's linear attention: a causal convolution over q, k and v, then a
recurrent state per value head [key_dim, value_dim] that decays by exp(g) and learns each token's
key -> value by the delta rule at rate beta; the output reads the state with the query, is
normalized per head and gated by silu(z).

A prompt (or a chunk of one) runs the chunked form, 64 tokens a chunk from its start, as HF's
torch fallback computes it; a decode step runs the recurrent form for every request at once.
The state lives in the request's slot (models/state_cache.py): the convolution's last
kernel - 1 inputs in the model's dtype, the recurrent state in float32. The scans run in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pdserve.models.layers.layernorm import RMSNorm
from pdserve.models.layers.linear import ReplicatedLinear
from pdserve.models.state_cache import StepPlan

CHUNK = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens by chunks: q, k [H, T, K] (normalized, q scaled), v [H, T, V],
    g, beta [H, T], state [H, K, V], all float32. Returns (out [H, T, V], the final state).

    Within a chunk the delta rule's updates are one triangular solve (the UT transform); the
    state carries from chunk to chunk."""
    heads, num_tokens, value_dim = v.shape
    pad = -num_tokens % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.unflatten(1, (-1, CHUNK)) for x in (q, k, k_beta, v_beta))
    g = g.unflatten(1, (-1, CHUNK)).cumsum(dim=-1)  # log decay from the chunk's start
    above = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(above, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * g.exp()[..., None], upper=False, unitriangular=True
    )
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_v)
    for i in range(q.shape[1]):
        u = new_v[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ u
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ u
    return out.reshape(heads, -1, value_dim)[:, :num_tokens], state


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of R requests: q, k [R, H, K] (normalized, q scaled), v [R, H, V],
    g, beta [R, H], state [R, H, K, V], float32. Returns (out [R, H, V], the new states)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


class GatedDeltaNet(nn.Module):
    """One layer, as a decoder layer's mixer: HF's `linear_attn` (Qwen3_5GatedDeltaNet)."""

    def __init__(self, hf_config: PretrainedConfig, params_dtype: torch.dtype) -> None:
        super().__init__()
        cfg = hf_config
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        hidden = cfg.hidden_size
        self.in_proj_qkv = ReplicatedLinear(hidden, self.conv_dim, False, params_dtype)
        self.in_proj_z = ReplicatedLinear(hidden, self.value_dim, False, params_dtype)
        self.in_proj_b = ReplicatedLinear(hidden, self.num_v_heads, False, params_dtype)
        self.in_proj_a = ReplicatedLinear(hidden, self.num_v_heads, False, params_dtype)
        self.conv1d = nn.Module()  # depthwise, no bias (HF's Conv1d weight layout)
        self.conv1d.weight = nn.Parameter(
            torch.empty(self.conv_dim, 1, self.conv_kernel, dtype=params_dtype),
            requires_grad=False,
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=params_dtype), False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=params_dtype), False)
        # The gated norm's weight is a plain scale (not Qwen3.5's 1 + weight).
        self.norm = RMSNorm(self.head_v_dim, cfg.rms_norm_eps, params_dtype)
        self.out_proj = ReplicatedLinear(self.value_dim, hidden, False, params_dtype)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state) of one request."""
        return (self.conv_dim, self.conv_kernel - 1), (
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
        )

    def forward_after_norm(
        self,
        norm: RMSNorm,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        state: tuple[torch.Tensor, torch.Tensor, StepPlan],
        attn_metadata: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's mixer call (positions and attention metadata unused: the slots
        are in the step's plan)."""
        x, residual = norm.with_residual(x, residual)
        return self(x, state), residual

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor, StepPlan]
    ) -> torch.Tensor:
        conv_states, ssm_states, plan = state
        if plan.fresh_slots.numel():  # new prompts, or ones recomputed after preemption
            conv_states[plan.fresh_slots] = 0
            ssm_states[plan.fresh_slots] = 0
        out = x.new_zeros(x.shape[0], self.out_proj.weight.shape[0])  # padding rows stay 0
        for rows, slot in plan.prompts:
            out[rows] = self._prompt(x[rows], conv_states[slot], ssm_states[slot])
        if plan.decode_rows.numel():
            rows, slots = plan.decode_rows, plan.decode_slots
            out[rows], conv, ssm = self._step(x[rows], conv_states[slots], ssm_states[slots])
            conv_states[slots], ssm_states[slots] = conv, ssm
        return out

    def _inputs(
        self, x: torch.Tensor, mixed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the convolved q/k/v [N, conv_dim] of tokens x: q, k [N, Hv, K] normalized (q
        not yet scaled), v [N, Hv, V], g and beta [N, Hv], in float32."""
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads  # each q/k head serves `repeat` v heads
        q, k = (
            _l2norm(t.unflatten(-1, (self.num_k_heads, self.head_k_dim))).repeat_interleave(
                repeat, dim=-2
            )
            for t in (q, k)
        )
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        beta = self.in_proj_b(x).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        return q, k, v, g, beta

    def _output(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """core [N, Hv, V] in x's dtype: normalized per head, gated by silu(z), projected."""
        z = self.in_proj_z(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        normed = self.norm(core.reshape(-1, self.head_v_dim)).view_as(core)
        gated = normed * F.silu(z.float())
        return self.out_proj(gated.to(x.dtype).flatten(1))

    def _prompt(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> torch.Tensor:
        """One request's tokens [T, hidden] from its states, which it leaves updated."""
        dtype, weight = x.dtype, self.conv1d.weight
        padded = torch.cat((conv_state.to(dtype), self.in_proj_qkv(x).t()), dim=1)
        conv_state.copy_(padded[:, -conv_state.shape[1] :])
        mixed = F.silu(F.conv1d(padded[None], weight, groups=self.conv_dim)[0]).t()
        q, k, v, g, beta = self._inputs(x, mixed)
        q = q * self.head_k_dim**-0.5
        heads_first = [t.transpose(0, 1) for t in (q, k, v, g, beta)]
        core, final = chunked_delta_rule(*heads_first, ssm_state.float())
        ssm_state.copy_(final)
        return self._output(core.transpose(0, 1).to(dtype), x)

    def _step(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token [R, hidden] of each of R requests from their states [R, ...]: (the
        output, the new conv states, the new recurrent states)."""
        dtype = x.dtype
        padded = torch.cat((conv_state.to(dtype), self.in_proj_qkv(x)[:, :, None]), dim=2)
        mixed = F.silu(F.conv1d(padded, self.conv1d.weight, groups=self.conv_dim)[:, :, -1])
        q, k, v, g, beta = self._inputs(x, mixed)
        q = q / self.head_k_dim**0.5
        core, state = recurrent_delta_rule(q, k, v, g, beta, ssm_state)
        return self._output(core.to(dtype), x), padded[:, :, 1:], state
