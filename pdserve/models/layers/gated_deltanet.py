"""Gated DeltaNet, Qwen3.5's linear attention: a causal convolution over q, k and v, then a
recurrent state per value head [key_dim, value_dim] that decays by exp(g) and learns each token's
key -> value by the delta rule at rate beta; the output reads the state with the query, is
normalized per head and gated by silu(z).

A prompt runs the chunked form (HF's torch fallback's math) on its whole 64-token chunks, which
the scheduler never splits (Qwen3.5's `prompt_chunk_alignment`), and the recurrent form on the
tokens after its last whole chunk; a decode step runs the recurrent form for every request at
once. So a token's bits depend on its prompt and position alone, never on the other requests of
its step or how the scheduler cut its prompt (batch invariance): every chunk is computed the same
way from the same state, and the recurrent form is elementwise per request.
The state lives in the request's slot (models/state_cache.py): the convolution's last
kernel - 1 inputs in the model's dtype, the recurrent state in float32. The scans run in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pdserve.distributed.parallel_state import get_tensor_model_parallel_world_size
from pdserve.kernels.cpu import recurrent as recurrent_cpu
from pdserve.kernels.cpu.elementwise import deltanet_gates
from pdserve.models.layers.layernorm import RMSNorm
from pdserve.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pdserve.models.state_cache import StepPlan
from pdserve.models.utils import sharded_loader

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
    """One chunk of CHUNK tokens: q, k [H, C, K] (normalized, q scaled), v [H, C, V],
    g, beta [H, C], state [H, K, V], all float32. Returns (out [H, C, V], the state after it).

    The chunk's delta rule updates are one triangular solve (the UT transform). A chunk at a
    time, never several in one batched matmul: a chunk's bits must not depend on how many
    others its prompt's step holds."""
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    g = g.cumsum(dim=-1)  # log decay from the chunk's start
    above = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(above, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * g.exp()[..., None], upper=False, unitriangular=True
    )
    u = new_v - k_cumdecay @ state
    out = (q * g.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ u
    k = k * (g[..., -1:] - g).exp()[..., None]
    state = state * g[..., -1].exp()[..., None, None] + k.transpose(-1, -2) @ u
    return out, state


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of R requests: q, k [R, H, K] (normalized, q scaled), v [R, H, V],
    decay (exp(g)) and beta [R, H], state [R, H, K, V], float32. Returns (out [R, H, V], the
    new states)."""
    state = state * decay[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


class GatedDeltaNet(nn.Module):
    """One layer, as a decoder layer's mixer: HF's `linear_attn` (Qwen3_5GatedDeltaNet), its
    heads split over TP ranks (q/k heads and the value heads they serve together): the input
    projections and the convolution by head, out_proj by input (its partial sums added over
    ranks); each rank keeps its heads' states."""

    def __init__(self, hf_config: PretrainedConfig, params_dtype: torch.dtype) -> None:
        super().__init__()
        cfg, tp = hf_config, get_tensor_model_parallel_world_size()
        self.num_k_heads = cfg.linear_num_key_heads // tp
        self.num_v_heads = cfg.linear_num_value_heads // tp
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        hidden, sections = cfg.hidden_size, [tp * self.key_dim] * 2 + [tp * self.value_dim]
        self.in_proj_qkv = MergedColumnParallelLinear(hidden, sections, False, params_dtype)
        self.in_proj_z = ColumnParallelLinear(hidden, tp * self.value_dim, False, params_dtype)
        self.in_proj_b = ColumnParallelLinear(hidden, tp * self.num_v_heads, False, params_dtype)
        self.in_proj_a = ColumnParallelLinear(hidden, tp * self.num_v_heads, False, params_dtype)
        self.conv1d = nn.Module()  # depthwise over q, k, v's channels, no bias (HF's layout)
        weight = torch.empty(self.conv_dim, 1, self.conv_kernel, dtype=params_dtype)
        self.conv1d.weight = sharded_loader(nn.Parameter(weight, False), sections)
        heads = [tp * self.num_v_heads]
        self.dt_bias = sharded_loader(
            nn.Parameter(torch.empty(self.num_v_heads, dtype=params_dtype), False), heads
        )
        self.A_log = sharded_loader(
            nn.Parameter(torch.empty(self.num_v_heads, dtype=params_dtype), False), heads
        )
        # The gated norm's weight is a plain scale (not Qwen3.5's 1 + weight).
        self.norm = RMSNorm(self.head_v_dim, cfg.rms_norm_eps, params_dtype)
        self.out_proj = RowParallelLinear(tp * self.value_dim, hidden, False, params_dtype)

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
        out_features = self.out_proj.weight.shape[0]
        return plan.run(x, out_features, (conv_states, ssm_states), self._prompt, self._step)

    def _inputs(self, x: torch.Tensor, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """From the convolved q/k/v [N, conv_dim] of tokens x: q, k [N, Hv, K] normalized (q
        not yet scaled), v [N, Hv, V], and g, exp(g), beta [N, Hv], in float32."""
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads  # each q/k head serves `repeat` v heads
        q, k = (
            _l2norm(t.unflatten(-1, (self.num_k_heads, self.head_k_dim))).repeat_interleave(
                repeat, dim=-2
            )
            for t in (q, k)
        )
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        gates = deltanet_gates(self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias)
        return q, k, v, *gates

    def _output(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """core [N, Hv, V] in x's dtype: normalized per head, gated by silu(z), projected."""
        z = self.in_proj_z(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        normed = self.norm(core.reshape(-1, self.head_v_dim)).view_as(core)
        gated = normed * F.silu(z.float())
        return self.out_proj(gated.to(x.dtype).flatten(1))

    def _prompt(
        self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> torch.Tensor:
        """One request's tokens [T, hidden] from its states, which it leaves updated: whole
        chunks by the chunked form, the rest token by token (the scheduler starts each step of a
        prompt at a chunk's start)."""
        dtype, weight = x.dtype, self.conv1d.weight
        padded = torch.cat((conv_state.to(dtype), self.in_proj_qkv(x).t()), dim=1)
        conv_state.copy_(padded[:, -conv_state.shape[1] :])
        mixed = F.silu(F.conv1d(padded[None], weight, groups=self.conv_dim)[0]).t()
        q, k, v, g, decay, beta = self._inputs(x, mixed)
        state, num_chunked = ssm_state.float(), x.shape[0] // CHUNK * CHUNK
        core, scaled_q = [], q * self.head_k_dim**-0.5
        for start in range(0, num_chunked, CHUNK):
            rows = slice(start, start + CHUNK)
            args = [t[rows].transpose(0, 1) for t in (scaled_q, k, v, g, beta)]
            out, state = chunked_delta_rule(*args, state)
            core.append(out.transpose(0, 1))
        ssm_state.copy_(state)
        slot = torch.zeros(1, dtype=torch.int64)  # the tail's steps, in place on its state
        for t in range(num_chunked, x.shape[0]):
            rows = slice(t, t + 1)
            core.append(
                self._recurrent(
                    q[rows] / self.head_k_dim**0.5,
                    k[rows],
                    v[rows],
                    decay[rows],
                    beta[rows],
                    ssm_state[None],
                    slot,
                )
            )
        return self._output(torch.cat(core).to(dtype), x)

    @staticmethod
    def _recurrent(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """recurrent_delta_rule on the states at `slots`, updated in place: one native pass
        where it applies (the prompt's tail and decode steps alike: the same bits)."""
        out = recurrent_cpu.deltanet_step(q, k, v, decay, beta, states, slots)
        if out is None:
            out, states[slots] = recurrent_delta_rule(q, k, v, decay, beta, states[slots])
        return out

    def _step(
        self, x: torch.Tensor, conv_state: torch.Tensor, states: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token [R, hidden] of each of R requests from their conv states [R, ...] and
        their recurrent states (`states` at `slots`, updated in place): (the output, the new
        conv states)."""
        dtype = x.dtype
        padded = torch.cat((conv_state.to(dtype), self.in_proj_qkv(x)[:, :, None]), dim=2)
        mixed = F.silu(F.conv1d(padded, self.conv1d.weight, groups=self.conv_dim)[:, :, -1])
        q, k, v, _, decay, beta = self._inputs(x, mixed)
        core = self._recurrent(q / self.head_k_dim**0.5, k, v, decay, beta, states, slots)
        return self._output(core.to(dtype), x), padded[:, :, 1:]
