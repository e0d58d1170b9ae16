"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

Numerics are HF's LlamaRMSNorm: the residual add in the activation dtype, the variance and the
scaling in float32, the result cast back to the activation dtype before the weight multiplies
it. The Triton kernel rounds at the same points, so it differs from the reference only by the
order of the variance sum and the rsqrt implementation.
"""

from __future__ import annotations

import torch

from pdserve.kernels import backend
from pdserve.kernels.cpu import elementwise as elementwise_cpu
from pdserve.kernels.triton import launch_configs

if backend.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        residual_ptr,
        weight_ptr,
        out_ptr,
        residual_out_ptr,
        stride_x,
        stride_residual,
        hidden_size,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per row: the whole row fits in registers for any model's hidden size.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < hidden_size
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        dtype = x.dtype
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(dtype)
            tl.store(residual_out_ptr + row * hidden_size + offs, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / hidden_size
        normed = (xf * tl.rsqrt(variance + eps)).to(dtype)
        weight = tl.load(weight_ptr + offs, mask=mask)
        out = weight.to(tl.float32) * normed.to(tl.float32)
        out = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * hidden_size + offs, out, mask=mask)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # residual + x, not x + residual: HF's order (the same value, as IEEE addition commutes).
    residual = residual + x
    return rms_norm_torch(residual, weight, eps), residual


def _rms_norm_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden_size = x.shape[-1]
    # Rows may be strided (q/k heads sliced out of one projection); elements must be adjacent.
    x2 = x.reshape(-1, hidden_size)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual2 = residual_out = None
    if residual is not None:
        residual2 = residual.reshape(-1, hidden_size)
        if residual2.stride(-1) != 1:
            residual2 = residual2.contiguous()
        residual_out = torch.empty_like(x2, memory_format=torch.contiguous_format)
    num_rows = x2.shape[0]
    if num_rows > 0:
        block = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_rows,)](
            x2,
            residual2 if residual2 is not None else x2,
            weight,
            out,
            residual_out if residual_out is not None else out,
            x2.stride(0),
            residual2.stride(0) if residual2 is not None else 0,
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=launch_configs.rms_norm_num_warps(block),
        )
    out = out.view(x.shape)
    return out, residual_out.view(x.shape) if residual_out is not None else None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, residual_out = _rms_norm_launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x, scaled by weight."""
    if backend.use_triton(x.device):
        return rms_norm_triton(x, weight, eps)
    if (cpu := elementwise_cpu.rms_norm(x, None, weight, eps)) is not None:
        return cpu[0]
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the next layer's input and its residual."""
    if backend.use_triton(x.device):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    if (cpu := elementwise_cpu.rms_norm(x, residual, weight, eps)) is not None:
        return cpu  # type: ignore[return-value]
    return fused_add_rms_norm_torch(x, residual, weight, eps)
