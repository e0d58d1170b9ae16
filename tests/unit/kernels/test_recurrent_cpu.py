"""The C++ Gated DeltaNet step (csrc/recurrent_cpu.cpp) against the torch recurrent form: the
same outputs and new states (float32, up to the order of its sums), in place on strided slots
(a state model's block rows) and only at the slots named, and a request's bits the same alone
as in any batch."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu import native
from pdserve.kernels.cpu import recurrent as recurrent_cpu
from pdserve.models.layers.gated_deltanet import recurrent_delta_rule

pytestmark = pytest.mark.skipif(
    not native.compiler_available(), reason="no C++ compiler on this machine"
)
H, K, V, SLOTS = 4, 16, 32, 40


def _inputs(rows: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k = (
        torch.nn.functional.normalize(torch.randn(rows, H, K, generator=gen), dim=-1)
        for _ in range(2)
    )
    v = torch.randn(rows, H, V, generator=gen)
    decay, beta = torch.rand(rows, H, generator=gen), torch.rand(rows, H, generator=gen)
    return q, k, v, decay, beta


def _states() -> torch.Tensor:
    """Slots strided as in a block: each slot's state followed by other bytes."""
    blocks = torch.randn(SLOTS, H * K * V + 24, generator=torch.Generator().manual_seed(1))
    return blocks[:, : H * K * V].view(SLOTS, H, K, V)


def test_matches_the_torch_form_in_place_at_its_slots() -> None:
    q, k, v, decay, beta = _inputs(17)
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(2))[:17]
    states = _states()
    before = states.clone()
    want_out, want_states = recurrent_delta_rule(q, k, v, decay, beta, before[slots])
    out = recurrent_cpu.deltanet_step(q, k, v, decay, beta, states, slots)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[slots], want_states, atol=1e-5, rtol=1e-5)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(states[untouched], before[untouched])


def test_a_requests_bits_do_not_depend_on_its_batch() -> None:
    q, k, v, decay, beta = _inputs(33)
    slots = torch.arange(33)
    batched_states, alone_states = _states(), _states()
    batched = recurrent_cpu.deltanet_step(q, k, v, decay, beta, batched_states, slots)
    for r in (0, 16, 32):
        row = slice(r, r + 1)
        alone = recurrent_cpu.deltanet_step(
            q[row], k[row], v[row], decay[row], beta[row], alone_states, slots[row]
        )
        assert torch.equal(alone, batched[row])
        assert torch.equal(alone_states[r], batched_states[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_step_matches_the_torch_scan_and_keeps_each_rows_bits(dtype: torch.dtype) -> None:
    """Mamba's step: the torch form's states (float32) and readout (the dtype's products,
    summed), in place at its slots; a row's bits the same alone as in its batch."""
    gen = torch.Generator().manual_seed(3)
    rows, channels, size = 9, 32, 16
    dt = torch.rand(rows, channels, generator=gen)
    A = -torch.rand(channels, size, generator=gen)
    B, C, u = (torch.randn(*shape, generator=gen).to(dtype) for shape in
               ((rows, size), (rows, size), (rows, channels)))  # fmt: skip
    slots = torch.arange(rows) * 2
    blocks = torch.randn(2 * rows, channels * size + 8, generator=gen)
    states = blocks[:, : channels * size].view(2 * rows, channels, size)
    before = states.clone()
    want = torch.exp(A[None] * dt[:, :, None]) * before[slots]
    want = want + dt[:, :, None] * B.float()[:, None, :] * u.float()[:, :, None]
    want_y = (want.to(dtype) * C[:, None, :]).sum(dim=-1)
    y = recurrent_cpu.mamba_step(dt, A, B, C, u, states, slots)
    torch.testing.assert_close(states[slots], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        y.to(dtype), want_y, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2
    )
    assert torch.equal(states[1::2], before[1::2])
    alone_states = before.clone()
    for r in (0, rows - 1):
        row = slice(r, r + 1)
        alone = recurrent_cpu.mamba_step(
            dt[row], A, B[row], C[row], u[row], alone_states, slots[row]
        )
        assert torch.equal(alone, y[row]) and torch.equal(alone_states[2 * r], states[2 * r])
